//! GGUF files as llama.cpp users have them: `fixtures/gguf/` holds tiny fixtures converted by
//! llama.cpp's own `convert_hf_to_gguf.py` (`scripts/make_gguf_fixtures.sh`). Loaded from the
//! GGUF alone (config from its metadata, tokenizer rebuilt from its vocabulary, tensors under
//! llama.cpp's names with `kv_b_proj` split in two), each must compute what transformers
//! computed on the HF checkpoint it came from.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use common::{fixture_dir, max_abs, max_abs_diff, max_abs_diff_rows, reference};
use deepinfer::deployment::Limits;
use deepinfer::engine::{self, StopConditions};
use deepinfer::host::{QuantizedWeight, Value};
use deepinfer::model::{ModelWeights, Precision, PrecisionChoice};
use deepinfer::runner::step::SamplingParams;
use deepinfer::runner::{self, Backend, Runner};
use deepinfer::source::ModelSource;
use deepinfer::tokenizer::{ChatMessage, Tokenizer};
use deepinfer::weights::Checkpoint;

const TOL: f32 = 1e-4;

/// The float32 conversions, by fixture.
const F32_FILES: &[(&str, &str)] = &[
    ("tiny-v3", "tiny-v3-f32.gguf"),
    ("tiny-v2-lite", "tiny-v2-lite-f32.gguf"),
];

fn gguf_path(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/gguf")
        .join(file)
}

fn open(path: &Path, max_batch: usize, precision: PrecisionChoice) -> Box<dyn Runner> {
    let mut limits = Limits::new(max_batch, 128);
    limits.precision = precision;
    runner::open(Backend::Cpu, path, &limits).unwrap()
}

fn f32_precision() -> PrecisionChoice {
    PrecisionChoice {
        dtype: deepinfer::model::DTypeChoice::Exactly(deepinfer::graph::DType::F32),
        ..PrecisionChoice::default()
    }
}

#[test]
fn f32_gguf_logits_match_transformers_at_every_position_and_in_decode() {
    for &(fixture, file) in F32_FILES {
        let r = reference(fixture);
        // `--dtype auto` of an F32 file is f32.
        let mut run = open(&gguf_path(file), 3, PrecisionChoice::default());
        let logits = engine::score(&mut run, &r.token_ids).unwrap();
        let worst = max_abs_diff_rows(&logits, &r.logits);
        eprintln!("{file}: max |logit - transformers| = {worst:e}");
        assert!(worst < TOL, "{file}: {worst}");
        let worst = common::decode_staggered(run.as_mut(), &r.token_ids, 3, &r.logits);
        eprintln!("{file} decode batch 3: max |logit - transformers| = {worst:e}");
        assert!(worst < TOL, "{file} decode: {worst}");
    }
}

#[test]
fn f32_gguf_greedy_continuation_matches_transformers() {
    for &(fixture, file) in F32_FILES {
        let r = reference(fixture);
        let mut run = open(&gguf_path(file), 1, PrecisionChoice::default());
        let stop = StopConditions {
            max_tokens: r.greedy.generated_token_ids.len(),
            stop_token_ids: vec![],
        };
        let got = engine::generate(
            &mut run,
            &r.greedy.prompt_token_ids,
            SamplingParams::GREEDY,
            &stop,
        )
        .unwrap();
        assert_eq!(got, r.greedy.generated_token_ids, "{file}");
    }
}

/// The metadata read back as a config is the fixture's config.json, field for field (the
/// inferred `topk_method`, YaRN's `mscale` and the head count included).
#[test]
fn gguf_metadata_is_the_checkpoints_config() {
    for &(fixture, file) in F32_FILES {
        let from_json = ModelSource::new(&fixture_dir(fixture))
            .unwrap()
            .config()
            .unwrap();
        let mut from_gguf = ModelSource::new(&gguf_path(file))
            .unwrap()
            .config()
            .unwrap();
        // The file's own dtype (config.json's torch_dtype is what the fixture's config was
        // written with, bf16 for tiny-v2-lite, whose safetensors are f32).
        assert_eq!(from_gguf.saved_dtype, Some(deepinfer::graph::DType::F32));
        from_gguf.saved_dtype = from_json.saved_dtype;
        // YaRN's mscale comes back through an f32 product (0.1 * mscale_all_dim): to f32's
        // precision.
        let (Some(ours), Some(theirs)) = (&mut from_gguf.rope.yarn, &from_json.rope.yarn) else {
            panic!("{file}: both configs use YaRN");
        };
        for (a, b) in [
            (&mut ours.mscale, theirs.mscale),
            (&mut ours.mscale_all_dim, theirs.mscale_all_dim),
        ] {
            let (x, y) = (a.unwrap(), b.unwrap());
            assert!((x - y).abs() <= 1e-6 * y.abs(), "{file}: mscale {x} vs {y}");
            *a = b;
        }
        assert_eq!(format!("{from_gguf:?}"), format!("{from_json:?}"), "{file}");
    }
}

/// The tokenizer rebuilt from the GGUF's vocabulary, merges and pre-tokenizer name encodes,
/// decodes and renders chats as the fixture's tokenizer.json and tokenizer_config.json do
/// (transformers' own files; the reference token ids came from them).
#[test]
fn gguf_tokenizer_is_the_checkpoints_tokenizer() {
    let texts = [
        "ROMEO:\nBut, soft! what light through yonder window breaks?\n",
        "  two  spaces,\ttabs\n\nand 12345 digits; it's done.",
        "non-ASCII: café, naïve, 東京, emoji 🙂",
        "",
    ];
    for &(fixture, file) in F32_FILES {
        let hf = Tokenizer::from_dir(&fixture_dir(fixture)).unwrap();
        let ours = Tokenizer::from_dir(&gguf_path(file)).unwrap();
        assert_eq!(ours.vocab_size(), hf.vocab_size(), "{file}");
        assert_eq!(ours.bos_token_id(), hf.bos_token_id(), "{file}");
        assert_eq!(ours.eos_token_id(), hf.eos_token_id(), "{file}");
        for text in texts {
            for special in [true, false] {
                let ids = hf.encode(text, special).unwrap();
                assert_eq!(ours.encode(text, special).unwrap(), ids, "{file}: {text:?}");
                assert_eq!(
                    ours.decode(&ids, false).unwrap(),
                    hf.decode(&ids, false).unwrap()
                );
            }
        }
        let chat = [
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Hello there"),
        ];
        assert_eq!(
            ours.apply_chat_template(&chat, true).unwrap(),
            hf.apply_chat_template(&chat, true).unwrap(),
            "{file}"
        );
    }
}

/// A Q8_0 file's linear weights run in the blocks the file stores: each held matrix multiplies
/// exactly (bit for bit) as candle's Q8_0 quantization of the HF checkpoint's f32 tensor does,
/// held the same way, so its blocks are those (two independent quantizers, gguf-py's and
/// candle's, agree; held matrices may keep only candle's repacked tiles, of rows padded to whole
/// 256-blocks, so their products are compared, not their bytes) and the right tensor is bound
/// to every matmul; what is not a linear weight (the
/// embedding, the halves of `kv_b_proj`) is dequantized. The logits then stay as near
/// transformers' f32 ones as `--quantize q8_0` keeps them (the bounds of `tests/quantized.rs`).
#[test]
fn q8_0_gguf_runs_its_own_blocks_and_stays_near_transformers() {
    let fixture = "tiny-v2-lite";
    let path = gguf_path("tiny-v2-lite-q8_0.gguf");
    let source = ModelSource::new(&path).unwrap();
    let (cfg, ckpt) = source.open().unwrap();
    let precision = Precision::all(deepinfer::graph::DType::F32);
    let weights = ModelWeights::load(&cfg, &ckpt, &precision).unwrap();
    let hf = Checkpoint::open(&fixture_dir(fixture)).unwrap();
    let mut checked = 0;
    for name in weights.specs().names() {
        let Value::Quantized(q) = weights.value(name).unwrap() else {
            continue;
        };
        for (e, block) in q.matrices().iter().enumerate() {
            let source = match &q {
                QuantizedWeight::Matrix(_) => name.to_string(),
                QuantizedWeight::Experts(_) => {
                    let (prefix, proj) = name.rsplit_once('.').unwrap();
                    format!("{prefix}.{e}.{proj}.weight")
                }
            };
            let dims = block.dims().to_vec();
            let f32_weight = hf.tensor_f32(&source, &dims).unwrap();
            let ours = QTensor::quantize(&f32_weight, GgmlDType::Q8_0).unwrap();
            let ours = QuantizedWeight::from_blocks(
                vec![(
                    GgmlDType::Q8_0.from_data(ours.data().unwrap()),
                    dims.clone(),
                )],
                false,
            )
            .unwrap();
            assert_eq!(block.format(), GgmlDType::Q8_0, "{source}");
            let x: Vec<f32> = (0..3 * dims[1])
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let x = Tensor::from_vec(x, (3, dims[1]), &Device::Cpu).unwrap();
            let got = block
                .matmul(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let want = ours
                .linear(&x)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            assert!(
                got == want,
                "{source}: the file's Q8_0 blocks are not candle's quantization of the HF tensor"
            );
            checked += 1;
        }
    }
    // 3 layers: q_proj, kv_a_proj_with_mqa, o_proj each; the dense layer's 3 MLP matrices; two
    // MoE layers of 8 experts x 3 and shared experts x 3; the LM head.
    assert_eq!(checked, 3 * 3 + 3 + 2 * (8 * 3 + 3) + 1);
    // Not linear weights: dequantized, within half a Q8_0 step of the f32 values.
    let embed = weights.get("model.embed_tokens.weight").unwrap();
    let want = hf
        .tensor_f32("model.embed_tokens.weight", embed.dims())
        .unwrap();
    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (ours, theirs) = (values(embed), values(&want));
    let step = max_abs(std::slice::from_ref(&theirs)) / 127.0;
    let err = max_abs_diff(&ours, &theirs);
    assert!(
        err <= step / 2.0 + 1e-6,
        "embedding off by {err} (step {step})"
    );

    let r = reference(fixture);
    let scale = max_abs(&r.logits);
    let mut run = runner::open_with_weights(
        Backend::Cpu,
        cfg,
        weights,
        deepinfer::deployment::RunnerConfig::for_limits(1, 128),
    )
    .unwrap();
    let logits = engine::score(&mut run, &r.token_ids).unwrap();
    assert_eq!(
        logits.len(),
        r.logits.len(),
        "Q8_0 GGUF: rows of logits scored vs transformers'"
    );
    let mut per_position: Vec<f32> = logits
        .iter()
        .zip(&r.logits)
        .map(|(a, b)| max_abs_diff(a, b) / scale)
        .collect();
    per_position.sort_by(f32::total_cmp);
    let n = per_position.len();
    eprintln!(
        "Q8_0 GGUF: |logit - transformers f32| / max |logit| per position: median {:.2e}, \
         third quartile {:.2e}, worst {:.2e}",
        per_position[n / 2],
        per_position[3 * n / 4],
        per_position[n - 1]
    );
    assert!(per_position[n / 2] < 0.04 && per_position[3 * n / 4] < 0.05);
}

/// A copy of `file` in a temporary directory, its metadata and tensors edited by `edit`.
fn edited_copy(
    file: &str,
    tag: &str,
    edit: impl FnOnce(&mut gguf_file::Content, &mut Vec<(String, QTensor)>),
) -> PathBuf {
    let src = gguf_path(file);
    let mut reader = std::fs::File::open(&src).unwrap();
    let mut content = gguf_file::Content::read(&mut reader).unwrap();
    let mut tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|n| {
            let t = content.tensor(&mut reader, n, &Device::Cpu).unwrap();
            (n.clone(), t)
        })
        .collect();
    edit(&mut content, &mut tensors);
    let dir = std::env::temp_dir().join(format!("deepinfer-gguf-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join(file);
    let mut w = std::fs::File::create(&out).unwrap();
    let metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut w, &metadata, &tensors).unwrap();
    out
}

fn open_error(path: &Path) -> String {
    let mut limits = Limits::new(1, 64);
    limits.precision = f32_precision();
    match runner::open(Backend::Cpu, path, &limits) {
        Ok(_) => panic!("{} opened", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_gguf_files_are_refused_naming_what_is_wrong() {
    let file = "tiny-v3-f32.gguf";
    // An architecture other than deepseek2.
    let llama = edited_copy(file, "arch", |c, _| {
        c.metadata.insert(
            "general.architecture".into(),
            gguf_file::Value::String("llama".into()),
        );
    });
    let msg = open_error(&llama);
    assert!(msg.contains("general.architecture is `llama`"), "{msg}");
    // A hyperparameter missing.
    let no_rank = edited_copy(file, "rank", |c, _| {
        c.metadata.remove("deepseek2.attention.kv_lora_rank");
    });
    let msg = open_error(&no_rank);
    assert!(
        msg.contains("deepseek2.attention.kv_lora_rank` is missing"),
        "{msg}"
    );
    // A pre-tokenizer the rebuild does not know.
    let pre = edited_copy(file, "pre", |c, _| {
        c.metadata.insert(
            "tokenizer.ggml.pre".into(),
            gguf_file::Value::String("qwen2".into()),
        );
    });
    let msg = Tokenizer::from_dir(&pre).unwrap_err().to_string();
    assert!(msg.contains("tokenizer.ggml.pre is `qwen2`"), "{msg}");
    // Half of kv_b_proj missing.
    let half = edited_copy(file, "half", |_, tensors| {
        tensors.retain(|(n, _)| n != "blk.1.attn_v_b.weight");
    });
    let msg = open_error(&half);
    assert!(msg.contains("blk.1.attn_v_b.weight"), "{msg}");
    // A truncated download.
    let bytes = std::fs::read(gguf_path(file)).unwrap();
    let dir = std::env::temp_dir().join(format!("deepinfer-gguf-{}-cut", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cut = dir.join(file);
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let msg = open_error(&cut);
    assert!(msg.contains("truncated"), "{msg}");
    // Not a GGUF file at all.
    std::fs::write(&cut, b"not gguf").unwrap();
    let msg = open_error(&cut);
    assert!(msg.contains("not a GGUF file"), "{msg}");
    // A path that is neither a directory nor a .gguf file.
    let msg = open_error(&dir.join("missing.gguf"));
    assert!(msg.contains("does not exist"), "{msg}");
}

/// `deepinfer ARGS --model MODEL`'s stdout; fails the test, with its stderr, if it fails.
fn deepinfer(args: &[&str], model: &Path) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_deepinfer"))
        .args(args)
        .arg("--model")
        .arg(model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}: {}",
        model.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The CLI end to end: `generate --model FILE.gguf --prompt` tokenizes with the file's own
/// tokenizer and continues as the HF checkpoint directory does.
#[test]
fn cli_generates_from_a_gguf_file_as_from_the_checkpoint_directory() {
    let args = [
        "generate",
        "--backend",
        "cpu",
        "--max-tokens",
        "8",
        "--prompt",
        "ROMEO: But, soft!",
    ];
    let from_dir = deepinfer(&args, &fixture_dir("tiny-v3"));
    assert!(!from_dir.trim().is_empty());
    assert_eq!(deepinfer(&args, &gguf_path("tiny-v3-f32.gguf")), from_dir);
}

/// A device backend streams the GGUF's tensors to the (simulated) NeuronCore at capture, the
/// joined `kv_b_proj` included, and computes what transformers did; a Q8_0 file is dequantized
/// at upload and runs too.
#[test]
fn sim_backend_runs_gguf_files() {
    let score = |file: &str, fixture: &str| {
        let r = reference(fixture);
        let ids: Vec<String> = r.token_ids.iter().map(u32::to_string).collect();
        let ids = ids.join(",");
        let args = [
            "score",
            "--backend",
            "sim",
            "--dtype",
            "f32",
            "--token-ids",
            &ids,
        ];
        let stdout = deepinfer(&args, &gguf_path(file));
        let line = stdout.lines().rfind(|l| l.starts_with('{')).unwrap();
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let logits: Vec<Vec<f32>> = serde_json::from_value(v["logits"].clone()).unwrap();
        (logits, r.logits)
    };
    let (got, want) = score("tiny-v3-f32.gguf", "tiny-v3");
    let worst = max_abs_diff_rows(&got, &want);
    assert!(worst < TOL, "sim, tiny-v3-f32.gguf: {worst}");
    let (got, want) = score("tiny-v2-lite-q8_0.gguf", "tiny-v2-lite");
    let scale = max_abs(&want);
    let worst = max_abs_diff_rows(&got, &want);
    // Q8_0 weights in f32 arithmetic: within the weights' own rounding of the f32 model.
    assert!(worst < 0.05 * scale, "sim, tiny-v2-lite-q8_0.gguf: {worst}");
}

/// What the CPU backend is predicted to hold before a tensor is read (the RAM check `serve`,
/// `generate` and `bench` make) is what it holds once loaded: a GGUF's own blocks, a float
/// GGUF and an HF checkpoint quantized to GGML blocks at load, int4 experts, and plain
/// weights.
#[test]
fn the_ram_a_model_will_hold_is_known_before_it_is_read() {
    use deepinfer::model::Quantize;
    let cases = [
        (gguf_path("tiny-v2-lite-q8_0.gguf"), Quantize::None),
        (gguf_path("tiny-v2-lite-f32.gguf"), Quantize::Q4K),
        (fixture_dir("tiny-v3"), Quantize::Q8_0),
        (fixture_dir("tiny-v3"), Quantize::ExpertsInt4),
        (fixture_dir("tiny-v3"), Quantize::None),
    ];
    for (path, quantize) in cases {
        let choice = PrecisionChoice {
            quantize,
            ..PrecisionChoice::default()
        };
        let (predicted, held) = common::predicted_and_held_bytes(&path, &choice);
        assert_eq!(predicted, held, "{} {quantize:?}", path.display());
    }
}
