//! A model over two "instances": a leader running ranks 0..2 of `--tp 4` and a follower running
//! 2..4, joined over TCP on localhost exactly as two trn1 hosts would be (`runner::open` with
//! `--ranks`/`--followers` on one side, `runner::follow` on the other). nrt-sim runs in one
//! process, so the two share its simulated cores and its collectives meet the four ranks.
//!
//! Checked: transformers' logits (within 1e-4, the follower's vocabulary slices crossing the
//! wire) and greedy tokens; a fault on any rank fails that step only; a follower that goes away
//! fails the step promptly, with its address, and every later step at once; a follower
//! started on another model is refused at launch, naming what differs.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fixture_dir, max_abs_diff_rows, reference};
use deepinfer::deployment::{InstanceSecret, Limits, RankSpan};
use deepinfer::engine::{self, StopConditions};
use deepinfer::graph::DType;
use deepinfer::model::DTypeChoice;
use deepinfer::runner::step::SamplingParams;
use deepinfer::runner::{self, instances, Backend};
use nrt_sim::{is_fault_child as is_child, run_test_in_child as run_child};

/// Two simulated cores (a trn1.2xlarge), shared by the two instances; the root communicator
/// the runner requires of a process running only some ranks.
const ENV: [(&str, &str); 2] = [
    (nrt_sim::ENV_NC_COUNT, "2"),
    ("NEURON_RT_ROOT_COMM_ID", "127.0.0.1:61999"),
];

/// `--tp 4 --ranks RANKS --followers FOLLOWERS --dtype f32` (transformers' reference is f32;
/// some fixtures say bf16 in config.json).
/// The secret the leader and followers of these tests share.
fn secret() -> InstanceSecret {
    InstanceSecret::new("instances-sim-test-secret").unwrap()
}

fn limits(ranks: RankSpan, followers: Vec<String>) -> Limits {
    let mut l = Limits {
        tp: 4,
        ranks: Some(ranks),
        followers,
        instance_secret: Some(secret()),
        ..Limits::new(2, 128)
    };
    l.precision.dtype = DTypeChoice::Exactly(DType::F32);
    l
}

/// Starts a follower of `model` for ranks `first..first + 2` on a thread; its address and its
/// end.
fn start_follower(
    model: PathBuf,
    first: usize,
) -> (String, std::thread::JoinHandle<deepinfer::Result<()>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let span = RankSpan { first, count: 2 };
    let t = std::thread::spawn(move || {
        runner::follow(Backend::Sim, &model, span, listener, &secret(), |_| {})
    });
    (addr, t)
}

/// Why `runner::open` fails.
fn open_err(backend: Backend, model: &std::path::Path, limits: &Limits) -> String {
    match runner::open(backend, model, limits) {
        Ok(_) => panic!("opened with {:?} {:?}", limits.ranks, limits.followers),
        Err(e) => e.to_string(),
    }
}

/// A TCP relay to `to` that the test can cut: the leader's view of a follower whose host or
/// network fails.
fn relay(to: String) -> (String, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let cut = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&cut);
    std::thread::spawn(move || {
        let (a, _) = listener.accept().unwrap();
        let b = TcpStream::connect(to).unwrap();
        let pipe = |mut from: TcpStream, mut into: TcpStream, flag: Arc<AtomicBool>| {
            std::thread::spawn(move || {
                from.set_read_timeout(Some(Duration::from_millis(20)))
                    .unwrap();
                let mut buf = [0u8; 1 << 16];
                loop {
                    if flag.load(Ordering::SeqCst) {
                        let _ = from.shutdown(Shutdown::Both);
                        let _ = into.shutdown(Shutdown::Both);
                        return;
                    }
                    match from.read(&mut buf) {
                        Ok(0) => return,
                        Ok(n) => {
                            if into.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                        Err(_) => return,
                    }
                }
            })
        };
        pipe(
            a.try_clone().unwrap(),
            b.try_clone().unwrap(),
            Arc::clone(&flag),
        );
        pipe(b, a, flag);
    });
    (addr, cut)
}

#[test]
fn a_leader_and_a_follower_match_transformers() {
    run_child("child_two_instances", &ENV);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_two_instances() {
    if !is_child() {
        return a_leader_and_a_follower_match_transformers();
    }
    for name in ["tiny-v3", "tiny-v2-lite"] {
        let r = reference(name);
        let (addr, follower) = start_follower(fixture_dir(name), 2);
        let lead = limits(RankSpan { first: 0, count: 2 }, vec![addr]);
        let mut leader = runner::open(Backend::Sim, &fixture_dir(name), &lead).unwrap();
        let logits = engine::score(&mut leader, &r.token_ids).unwrap();
        let diff = max_abs_diff_rows(&logits, &r.logits);
        eprintln!("{name}: two instances at --tp 4 vs transformers {diff:e}");
        assert!(diff < 1e-4, "{name}: {diff}");
        let stop = StopConditions {
            max_tokens: r.greedy.generated_token_ids.len(),
            stop_token_ids: vec![],
        };
        let got = engine::generate(
            &mut leader,
            &r.greedy.prompt_token_ids,
            SamplingParams::GREEDY,
            &stop,
        )
        .unwrap();
        assert_eq!(got, r.greedy.generated_token_ids, "{name}");
        // The leader's end is the follower's.
        drop(leader);
        follower.join().unwrap().unwrap();
    }
    // Split sampling (`--split-sampler`): the follower takes it from the launch, captures the
    // split graphs and runs both halves of every decode step the leader sends.
    let r = reference("tiny-v3");
    let (addr, follower) = start_follower(fixture_dir("tiny-v3"), 2);
    let lead = Limits {
        split_sampler: true,
        ..limits(RankSpan { first: 0, count: 2 }, vec![addr])
    };
    let mut leader = runner::open(Backend::Sim, &fixture_dir("tiny-v3"), &lead).unwrap();
    let stop = StopConditions {
        max_tokens: r.greedy.generated_token_ids.len(),
        stop_token_ids: vec![],
    };
    let prompt = &r.greedy.prompt_token_ids;
    let got = engine::generate(&mut leader, prompt, SamplingParams::GREEDY, &stop).unwrap();
    assert_eq!(
        got, r.greedy.generated_token_ids,
        "split sampling over two instances"
    );
    drop(leader);
    follower.join().unwrap().unwrap();
    // Speculative decoding (`--speculative-tokens 1`): the follower loads the MTP layer and
    // captures the draft and verify graphs from the launch, and runs every verify and draft
    // step the leader sends; the leader drafts from the hidden states of its first rank.
    let (addr, follower) = start_follower(fixture_dir("tiny-v3-mtp"), 2);
    let lead = Limits {
        speculative_tokens: 1,
        ..limits(RankSpan { first: 0, count: 2 }, vec![addr])
    };
    let leader = runner::open(Backend::Sim, &fixture_dir("tiny-v3-mtp"), &lead).unwrap();
    let mut s = engine::Scheduler::new(leader, None, Vec::new()).unwrap();
    let n = r.greedy.generated_token_ids.len();
    s.add(0, prompt.clone(), engine::GenerationParams::greedy(n))
        .unwrap();
    let mut got = Vec::new();
    while !s.is_idle() {
        for o in s.step() {
            match o.event {
                engine::Event::Token(t) => got.push(t.token),
                engine::Event::Failed { message, .. } => panic!("{message}"),
                _ => {}
            }
        }
    }
    assert_eq!(
        got, r.greedy.generated_token_ids,
        "drafting over two instances"
    );
    assert!(s.speculative_stats().drafted > 0);
    drop(s);
    follower.join().unwrap().unwrap();
}

#[test]
fn a_fault_on_any_rank_of_either_instance_fails_only_that_step() {
    // Four executions a step over the two instances; the seventh is one rank's share of the
    // second step, on whichever instance reaches it.
    run_child(
        "child_instance_fault",
        &[
            ENV[0],
            ENV[1],
            (nrt_sim::ENV_FAIL_EXECUTE, "7"),
            (nrt_sim::ENV_COLLECTIVE_TIMEOUT_MS, "60000"),
        ],
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_instance_fault() {
    if !is_child() {
        return a_fault_on_any_rank_of_either_instance_fails_only_that_step();
    }
    let ids = [3u32, 4, 5];
    let (addr, follower) = start_follower(fixture_dir("tiny-v3"), 2);
    let lead = limits(RankSpan { first: 0, count: 2 }, vec![addr]);
    let mut leader = runner::open(Backend::Sim, &fixture_dir("tiny-v3"), &lead).unwrap();
    let first = engine::score(&mut leader, &ids).unwrap();
    let t = Instant::now();
    let err = engine::score(&mut leader, &ids).unwrap_err().to_string();
    assert!(
        err.contains("NRT_EXEC_COMPLETED_WITH_ERR"),
        "the failing rank's own error: {err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    let again = engine::score(&mut leader, &ids).unwrap();
    assert_eq!(again, first);
    drop(leader);
    follower.join().unwrap().unwrap();
}

#[test]
fn a_lost_follower_fails_the_step_promptly_and_every_step_after() {
    // The leader's own ranks wait in the collective for the lost ones until nrt-sim's
    // collective timeout (libnrt's own on a trn1).
    run_child(
        "child_lost_follower",
        &[ENV[0], ENV[1], (nrt_sim::ENV_COLLECTIVE_TIMEOUT_MS, "2000")],
    );
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_lost_follower() {
    if !is_child() {
        return a_lost_follower_fails_the_step_promptly_and_every_step_after();
    }
    let ids = [3u32, 4, 5];
    let (addr, _follower) = start_follower(fixture_dir("tiny-v3"), 2);
    let (via, cut) = relay(addr);
    let lead = limits(RankSpan { first: 0, count: 2 }, vec![via.clone()]);
    let mut leader = runner::open(Backend::Sim, &fixture_dir("tiny-v3"), &lead).unwrap();
    engine::score(&mut leader, &ids).unwrap();
    cut.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(100));
    let t = Instant::now();
    let err = engine::score(&mut leader, &ids).unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert_eq!(err.kind(), deepinfer::error::ErrorKind::Device, "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&via), "names the follower: {msg}");
    let t = Instant::now();
    let again = engine::score(&mut leader, &ids).unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(
        again.contains("ranks 2..4 is lost") && again.contains("restart every instance"),
        "{again}"
    );
}

#[test]
fn a_follower_of_another_model_or_the_wrong_ranks_is_refused_at_launch() {
    run_child("child_mismatch", &ENV);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_mismatch() {
    if !is_child() {
        return a_follower_of_another_model_or_the_wrong_ranks_is_refused_at_launch();
    }
    // Another model.
    let (addr, follower) = start_follower(fixture_dir("tiny-v2-lite"), 2);
    let lead = limits(RankSpan { first: 0, count: 2 }, vec![addr.clone()]);
    let err = open_err(Backend::Sim, &fixture_dir("tiny-v3"), &lead);
    assert!(
        err.contains(&addr) && err.contains("its model (config.json) is not the leader's"),
        "{err}"
    );
    assert!(follower.join().unwrap().is_err());

    // Ranks the launch's degree does not have: the follower says why it cannot start.
    let (addr, follower) = start_follower(fixture_dir("tiny-v3"), 3);
    let lead = limits(RankSpan { first: 0, count: 2 }, vec![addr.clone()]);
    let err = open_err(Backend::Sim, &fixture_dir("tiny-v3"), &lead);
    assert!(
        err.contains(&addr)
            && err.contains("could not start")
            && err.contains("ranks 3..5 of a model split over --tp 4"),
        "{err}"
    );
    assert!(follower.join().unwrap().is_err());
}

/// Only the leader holding the shared secret drives a follower: a stranger's connection (no
/// proof, or a proof of another secret) is refused before it can send a step, the follower
/// keeps waiting, and then serves its leader, whose scores match transformers'. A leader with
/// another secret gets an error naming the follower.
#[test]
fn only_a_leader_proving_the_shared_secret_drives_a_follower() {
    run_child("child_auth", &ENV);
}

#[test]
#[ignore = "runs in a child process started by its parent test"]
fn child_auth() {
    if !is_child() {
        return only_a_leader_proving_the_shared_secret_drives_a_follower();
    }
    let (addr, follower) = start_follower(fixture_dir("tiny-v3"), 2);
    // A stranger: reads the challenge, sends a launch without a valid proof.
    let mut s = TcpStream::connect(&addr).unwrap();
    // A frame: its length (tag included, u32 little-endian), the tag, the body.
    let frame = |s: &mut TcpStream| {
        let mut len = [0u8; 4];
        s.read_exact(&mut len).unwrap();
        let mut buf = vec![0u8; u32::from_le_bytes(len) as usize];
        s.read_exact(&mut buf).unwrap();
        (buf[0], String::from_utf8(buf[1..].to_vec()).unwrap())
    };
    let (tag, challenge) = frame(&mut s);
    assert_eq!(
        (tag, challenge.len()),
        (9, 64),
        "a challenge of 32 bytes in hex"
    );
    let launch = serde_json::to_string(&instances::Launch::of(&limits(
        RankSpan { first: 0, count: 2 },
        vec![],
    )))
    .unwrap();
    let body = format!("{}\n{launch}", "00".repeat(32));
    let mut msg = ((body.len() + 1) as u32).to_le_bytes().to_vec();
    msg.push(1);
    msg.extend_from_slice(body.as_bytes());
    s.write_all(&msg).unwrap();
    let (tag, why) = frame(&mut s);
    assert_eq!(tag, 6, "refused: {why}");
    assert!(why.contains("authentication failed"), "{why}");
    drop(s);
    // A leader with another secret is refused the same way, and says which follower.
    let wrong = Limits {
        instance_secret: Some(InstanceSecret::new("some-other-secret-value").unwrap()),
        ..limits(RankSpan { first: 0, count: 2 }, vec![addr.clone()])
    };
    let err = open_err(Backend::Sim, &fixture_dir("tiny-v3"), &wrong);
    assert!(
        err.contains(&addr) && err.contains("authentication failed"),
        "{err}"
    );
    // The follower still waits for its leader, and serves it.
    let r = reference("tiny-v3");
    let lead = limits(RankSpan { first: 0, count: 2 }, vec![addr]);
    let mut leader = runner::open(Backend::Sim, &fixture_dir("tiny-v3"), &lead).unwrap();
    let logits = engine::score(&mut leader, &r.token_ids).unwrap();
    let worst = max_abs_diff_rows(&logits, &r.logits);
    assert!(worst < 1e-4, "{worst}");
    drop(leader);
    follower.join().unwrap().unwrap();
    // Without a secret, a leader refuses to launch.
    let none = Limits {
        instance_secret: None,
        ..limits(RankSpan { first: 0, count: 2 }, vec!["127.0.0.1:1".into()])
    };
    let err = open_err(Backend::Sim, &fixture_dir("tiny-v3"), &none);
    assert!(err.contains("DEEPINFER_INSTANCE_SECRET"), "{err}");
}

#[test]
fn ranks_and_followers_that_cannot_work_are_refused_before_loading() {
    let dir = fixture_dir("tiny-v3");
    let cases = [
        (
            Backend::Cpu,
            limits(RankSpan { first: 0, count: 2 }, vec![]),
            "use --backend neuron",
        ),
        (
            Backend::Sim,
            limits(RankSpan { first: 2, count: 4 }, vec![]),
            "--ranks 2..6 is not a span of the --tp 4 ranks",
        ),
        (
            Backend::Sim,
            limits(RankSpan { first: 2, count: 2 }, vec!["127.0.0.1:1".into()]),
            "this process is the leader: --ranks 0..K",
        ),
        (
            Backend::Sim,
            Limits {
                tp: 4,
                followers: vec!["127.0.0.1:1".into()],
                ..Limits::new(2, 128)
            },
            "--followers needs --ranks 0..K",
        ),
    ];
    for (backend, l, want) in cases {
        let err = open_err(backend, &dir, &l);
        assert!(err.contains(want), "{err}");
    }
    assert_eq!(
        "32..64".parse::<RankSpan>().unwrap(),
        RankSpan {
            first: 32,
            count: 32
        }
    );
    for bad in ["4..4", "5..2", "0-2", "a..b", ".."] {
        let e = bad.parse::<RankSpan>().unwrap_err().to_string();
        assert!(e.contains("expected FIRST..END"), "{bad}: {e}");
    }
}
