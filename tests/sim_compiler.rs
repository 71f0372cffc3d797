//! nrt-sim's stand-in compiler (`nrt-sim-neuronx-cc`) through the real compile driver and NEFF
//! cache: the container it writes names the tensors after the convention it is given (flag over
//! environment), the convention is part of the cache key, and it refuses what neuronx-cc would
//! (unknown arguments, another framework, a module it cannot run, a convention nobody follows).

use std::path::Path;
use std::process::Command;

use deepinfer::backend::hlo::emit;
use deepinfer::backend::neuron::compile::{compile_all, CompileJob, CompilerConfig};
use deepinfer::backend::neuron::sim_neff::{NeffNames, SimNeff, ENV_NEFF_NAMES, NAMES_FLAG};
use deepinfer::graph::{DType, GraphBuilder, InputRole};
use deepinfer::runner;

const STAND_IN: &str = env!("CARGO_BIN_EXE_nrt-sim-neuronx-cc");

/// `y = x * 2`, `c <- c + x` (aliased).
fn hlo() -> Vec<u8> {
    let b = GraphBuilder::new("cc_test");
    let x = b
        .input("x", InputRole::Metadata, vec![3], DType::F32)
        .unwrap();
    let c = b
        .input("c", InputRole::CacheRoot, vec![3], DType::F32)
        .unwrap();
    b.output("y", &x.affine(2.0, 0.0).unwrap()).unwrap();
    b.output_aliased("c", &c.add(&x).unwrap(), &c).unwrap();
    emit::to_bytes(&emit::emit(&b.finish().unwrap()).unwrap())
}

fn config(cache: &Path, names: NeffNames) -> CompilerConfig {
    CompilerConfig {
        program: STAND_IN.into(),
        cache_dir: cache.to_path_buf(),
        ..runner::sim_compiler_config(names)
    }
}

fn job() -> CompileJob {
    CompileJob {
        name: "cc_test".into(),
        hlo: hlo(),
    }
}

#[test]
fn the_driver_caches_one_container_per_naming_convention() {
    let dir = tempfile::tempdir().unwrap();
    let mut keys = Vec::new();
    for names in NeffNames::ALL {
        let cfg = config(dir.path(), names);
        let first = compile_all(&cfg, &[job()]).unwrap().remove(0);
        assert!(
            !first.cache_hit,
            "{names:?}: compiled, not taken from another convention's entry"
        );
        let neff = SimNeff::decode(&first.neff).unwrap();
        assert_eq!(neff.hlo, hlo(), "the container carries the HLO unchanged");
        let (ins, outs) = match names {
            NeffNames::Ours | NeffNames::MustAlias => (["x", "c.must_alias_input"], ["y", "c"]),
            NeffNames::Positional => (["input0", "input1"], ["output0", "output1"]),
        };
        assert_eq!(
            (neff.inputs, neff.outputs),
            (
                ins.map(String::from).to_vec(),
                outs.map(String::from).to_vec()
            )
        );
        let again = compile_all(&cfg, &[job()]).unwrap().remove(0);
        assert!(again.cache_hit, "{names:?}");
        assert_eq!(again.neff, first.neff);
        keys.push(first.key);
    }
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 3, "the convention is part of the cache key");
}

#[test]
fn a_convention_nobody_follows_fails_the_compile() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), NeffNames::Ours);
    // What `sim_compiler_config_from_env` passes for `NRT_SIM_NEFF_NAMES=input-i`.
    *cfg.flags.last_mut().unwrap() = format!("{NAMES_FLAG}=input-i");
    let err = compile_all(&cfg, &[job()]).unwrap_err().to_string();
    assert!(
        err.contains("\"input-i\" is not a naming convention"),
        "{err}"
    );
}

fn run(args: &[&str], env: &[(&str, &str)], cwd: &Path) -> (bool, String, String) {
    let out = Command::new(STAND_IN)
        .args(args)
        .env_remove(ENV_NEFF_NAMES)
        .envs(env.iter().copied())
        .current_dir(cwd)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_stand_in_takes_neuronx_cc_s_command_line_and_refuses_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("model.hlo.pb"), hlo()).unwrap();
    std::fs::write(d.join("junk.pb"), b"\xff\xff not a module").unwrap();
    let (ok, out, _) = run(&["--version"], &[], d);
    assert!(
        ok && out.starts_with("NeuronX Compiler version nrt-sim-"),
        "{out}"
    );
    let compile = |extra: &[&str], env: &[(&str, &str)]| {
        let mut args = vec![
            "compile",
            "--framework=XLA",
            "--target=trn1",
            "model.hlo.pb",
        ];
        args.push("--output=model.neff");
        args.extend_from_slice(extra);
        let _ = std::fs::remove_file(d.join("model.neff"));
        let (ok, _, err) = run(&args, env, d);
        let neff = std::fs::read(d.join("model.neff")).ok();
        (ok, err, neff.map(|n| SimNeff::decode(&n).unwrap().inputs))
    };
    // The driver's default flags are accepted; the environment chooses when no flag does; the
    // flag wins over it.
    let (ok, err, inputs) = compile(
        &["--model-type=transformer", "--auto-cast=none", "-O1"],
        &[],
    );
    assert!(ok, "{err}");
    assert_eq!(
        inputs.unwrap(),
        ["x", "c.must_alias_input"],
        "the default is must-alias"
    );
    let positional = [(ENV_NEFF_NAMES, "positional")];
    assert_eq!(compile(&[], &positional).2.unwrap(), ["input0", "input1"]);
    let ours = format!("{NAMES_FLAG}=ours");
    assert_eq!(
        compile(&[&ours], &positional).2.unwrap(),
        ["x", "c.must_alias_input"]
    );
    // Refused, with nothing written.
    for (extra, env, why) in [
        (
            vec!["--no-such-flag"],
            vec![],
            "unrecognized argument: --no-such-flag",
        ),
        (
            vec!["--nrt-sim-neff-names=inputs"],
            vec![],
            "\"inputs\" is not a naming convention",
        ),
        (
            vec![],
            vec![(ENV_NEFF_NAMES, "bogus")],
            "\"bogus\" is not a naming convention",
        ),
        (vec!["other.pb"], vec![], "more than one input file"),
    ] {
        let (ok, err, neff) = compile(&extra, &env);
        assert!(!ok && neff.is_none(), "{extra:?} {env:?}");
        assert!(err.contains(why), "{err}");
    }
    let (ok, _, err) = run(
        &[
            "compile",
            "--framework=TENSORFLOW",
            "model.hlo.pb",
            "--output=x.neff",
        ],
        &[],
        d,
    );
    assert!(!ok && err.contains("--framework must be XLA"), "{err}");
    let (ok, _, err) = run(
        &["compile", "--framework=XLA", "junk.pb", "--output=x.neff"],
        &[],
        d,
    );
    assert!(
        !ok && err.contains("the HLO module cannot be compiled"),
        "{err}"
    );
    assert!(!d.join("x.neff").exists());
}
