//! The cost model on the published DeepSeek-V2-Lite and V3 configs (config.json alone): decode
//! graphs read at most 1.15x the floor at batch 1 and 64.

use std::path::PathBuf;

use deepinfer::export::{lower, LowerOptions};
use deepinfer::model::PrecisionChoice;

#[test]
fn decode_reads_stay_near_the_floor_on_published_configs() {
    for name in ["deepseek-v2-lite", "deepseek-v3"] {
        let dir =
            std::env::temp_dir().join(format!("deepinfer-cost-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("fixtures/configs/{name}.json"));
        std::fs::copy(src, dir.join("config.json")).unwrap();
        let opts = LowerOptions {
            batch_sizes: vec![1, 64],
            ctx: 1024,
            inputs_from_token_ids: None,
            precision: PrecisionChoice::default(),
        };
        let m = lower(&dir, &dir.join("out"), &opts).unwrap();
        let floored: Vec<_> = m.costs.iter().filter(|c| c.floor.is_some()).collect();
        // One decode graph per batch size has a floor; none would make the loop below vacuous.
        assert_eq!(
            floored.len(),
            opts.batch_sizes.len(),
            "{name}: decode graphs with a floor"
        );
        for c in floored {
            let ratio = c.bytes_read() as f64 / c.floor.unwrap().total();
            eprintln!("{name} {}: read/floor = {ratio:.3}", c.name);
            assert!(ratio <= 1.15, "{name} {}: {ratio}", c.name);
            assert!(
                ratio >= 0.99,
                "{name} {}: reads less than the floor ({ratio})",
                c.name
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
