//! DeepSeek Sparse Attention's token selection (`model::indexer`) against a plain reference: a
//! stable sort of each row by value, largest first, ties in position order, cut at k. Both
//! graph forms are checked, decode's indices (sorted directly, and tiled under a sort-width
//! limit) and prefill's mask (two bisection thresholds, no sort), on rows with ties at the
//! boundary, `-inf` (hidden) positions and fewer finite values than k.

use candle_core::{Device, Tensor as CTensor};
use deepinfer::backend::cpu;
use deepinfer::graph::{DType, GraphBuilder, InputRole};
use deepinfer::model::indexer;

/// The reference selection: positions of the k largest, largest first, lower position first
/// among equals.
fn reference_top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Deterministic rows with many ties: values from a small set, some hidden (`-inf`).
fn rows(rows: usize, n: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (state >> 33) as u32
    };
    (0..rows)
        .map(|r| {
            (0..n)
                .map(|_| match next() % 10 {
                    0 | 1 => f32::NEG_INFINITY,
                    v if r % 2 == 0 => v as f32 * 0.25, // few distinct values: ties everywhere
                    _ => (next() % 100_000) as f32 / 1e3, // mostly distinct
                })
                .collect()
        })
        .collect()
}

fn run_indices(data: &[Vec<f32>], k: usize, width: usize) -> Vec<Vec<usize>> {
    let (r, n) = (data.len(), data[0].len());
    let b = GraphBuilder::new("top_k_indices");
    let x = b
        .input("x", InputRole::Metadata, [r, n], DType::F32)
        .unwrap();
    let picked = indexer::top_k_indices_within(&x, k, width).unwrap();
    b.output("picked", &picked).unwrap();
    let g = b.finish().unwrap();
    let flat: Vec<f32> = data.concat();
    let input = CTensor::from_vec(flat, (r, n), &Device::Cpu).unwrap();
    let out = cpu::run(&g, &[input]).unwrap();
    out[0]
        .to_vec2::<i32>()
        .unwrap()
        .into_iter()
        .map(|row| row.into_iter().map(|i| i as usize).collect())
        .collect()
}

fn run_mask(data: &[Vec<f32>], k: usize) -> Vec<Vec<u8>> {
    let (r, n) = (data.len(), data[0].len());
    let b = GraphBuilder::new("top_k_mask");
    let x = b
        .input("x", InputRole::Metadata, [r, n], DType::F32)
        .unwrap();
    let mask = indexer::top_k_mask(&x, k)
        .unwrap()
        .to_dtype(DType::U8)
        .unwrap();
    b.output("mask", &mask).unwrap();
    let g = b.finish().unwrap();
    let input = CTensor::from_vec(data.concat(), (r, n), &Device::Cpu).unwrap();
    cpu::run(&g, &[input]).unwrap()[0].to_vec2::<u8>().unwrap()
}

#[test]
fn decode_indices_match_a_stable_sort_with_and_without_tiling() {
    let data = rows(6, 200, 7);
    for k in [1, 5, 16, 64] {
        let want: Vec<Vec<usize>> = data.iter().map(|r| reference_top_k(r, k)).collect();
        // Untiled (the context fits one sort), then tiles of 128 and of 32 (two levels of
        // candidates: 7 tiles x 16 = 112 > 32).
        for width in [256, 128, 32] {
            if k > width / 2 && width < 200 {
                continue;
            }
            let got = run_indices(&data, k, width);
            assert_eq!(got.len(), want.len(), "k {k} width {width}: rows");
            for (row, (g, w)) in got.iter().zip(&want).enumerate() {
                // Hidden positions may fill a row short of finite values; which ones is not
                // specified, only that every finite value ranks first.
                let finite = data[row].iter().filter(|v| v.is_finite()).count();
                let cut = k.min(finite);
                assert_eq!(&g[..cut], &w[..cut], "k {k} width {width} row {row}");
                assert!(g[cut..].iter().all(|&i| data[row][i] == f32::NEG_INFINITY));
            }
        }
    }
}

#[test]
fn wide_contexts_are_refused_only_when_they_cannot_be_tiled() {
    let b = GraphBuilder::new("t");
    let x = b
        .input("x", InputRole::Metadata, [1, 100], DType::F32)
        .unwrap();
    let err = indexer::top_k_indices_within(&x, 40, 64)
        .unwrap_err()
        .to_string();
    assert!(err.contains("40 tokens") && err.contains("64"), "{err}");
    // The published V3.2 selection at 128k positions fits under neuronx-cc's limit.
    let x = b
        .input("y", InputRole::Metadata, [1, 131_072], DType::F32)
        .unwrap();
    let picked = indexer::top_k_indices(&x, 2048).unwrap();
    assert_eq!(picked.dims(), [1, 2048]);
}

#[test]
fn prefill_mask_selects_exactly_the_reference_set() {
    let data = rows(8, 97, 11);
    for k in [1, 3, 10, 40, 97, 200] {
        let got = run_mask(&data, k);
        for (row, mask) in got.iter().enumerate() {
            let finite = data[row].iter().filter(|v| v.is_finite()).count();
            let want = reference_top_k(&data[row], k.min(finite));
            let selected: Vec<usize> = (0..mask.len())
                .filter(|&i| mask[i] != 0 && data[row][i].is_finite())
                .collect();
            let mut want_sorted = want.clone();
            want_sorted.sort_unstable();
            assert_eq!(selected, want_sorted, "k {k} row {row}");
            // Exactly min(k, n) entries in all (hidden ones make up a short row).
            let total = mask.iter().filter(|&&m| m != 0).count();
            assert_eq!(total, k.min(mask.len()), "k {k} row {row}");
        }
    }
}
