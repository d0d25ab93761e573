//! KV cache groups: CPU time of one decode step and blocks held, for a Gemma 3-like layout
//! (5 sliding-window layers with a 512-token window per full-attention layer, block size 16)
//! on `KvCacheManager`, against the same manager with one full-attention group holding every
//! layer's KV (what a manager without groups must allocate). Prints figures; no timing assertions.
//! Run: `cargo bench -p pagedkv-core --bench hybrid`.

use pagedkv_core::{CacheConfig, GroupSpec, KvCacheManager, SequenceSpec, StepRequest};
use std::time::Instant;

const BS: u32 = 16;
const SEQS: u64 = 64;
const PROMPT: usize = 2000;
const STEPS: usize = 256;

fn main() {
    let blocks_per_seq = (PROMPT + STEPS).div_ceil(BS as usize) as u32 + 2;
    let num_blocks = 2 * blocks_per_seq * SEQS as u32 + 2;
    for retention in [0u32, 1024] {
        let mut cfg = CacheConfig::with_groups(
            num_blocks,
            vec![
                GroupSpec::full(BS, 512),
                GroupSpec::sliding_window(BS, 512, 512),
            ],
            vec![1, 1, 1, 1, 1, 0],
        );
        cfg.retention_interval = retention;
        let m = KvCacheManager::new(cfg).unwrap();
        let ids: Vec<u64> = (1..=SEQS).collect();
        for &id in &ids {
            let p: Vec<u32> = (0..PROMPT as u32)
                .map(|t| t + id as u32 * 100_000)
                .collect();
            m.add_sequence(id, p, SequenceSpec::default()).unwrap();
        }
        let t = Instant::now();
        let out = m.step(&StepRequest {
            seq_ids: ids.clone(),
            num_new_tokens: vec![PROMPT as u32; SEQS as usize],
            ..Default::default()
        });
        assert!(out.error.is_none());
        let prefill = t.elapsed();
        let req = StepRequest {
            seq_ids: ids.clone(),
            num_new_tokens: vec![1; SEQS as usize],
            append_indptr: (0..=SEQS as u32).collect(),
            append_tokens: vec![7; SEQS as usize],
        };
        let t = Instant::now();
        for _ in 0..STEPS {
            let out = m.step(&req);
            assert!(out.error.is_none(), "{:?}", out.error);
        }
        let per_step = t.elapsed().as_secs_f64() / STEPS as f64;
        let held = m.num_blocks_held(1).unwrap();
        println!(
            "hybrid (retention {retention}): prefill of {SEQS} x {PROMPT} tokens {:.1} ms; decode step of {SEQS} seqs {:.1} us ({:.0} ns per seq); blocks held per seq: full {}, sliding {}",
            prefill.as_secs_f64() * 1e3,
            per_step * 1e6,
            per_step * 1e9 / SEQS as f64,
            held[0],
            held[1]
        );
    }
    let m = KvCacheManager::new(CacheConfig::new(num_blocks, BS)).unwrap();
    let ids: Vec<u64> = (1..=SEQS).collect();
    for &id in &ids {
        let p: Vec<u32> = (0..PROMPT as u32)
            .map(|t| t + id as u32 * 100_000)
            .collect();
        m.add_sequence(id, p, SequenceSpec::default()).unwrap();
    }
    let t = Instant::now();
    m.step(&StepRequest {
        seq_ids: ids.clone(),
        num_new_tokens: vec![PROMPT as u32; SEQS as usize],
        ..Default::default()
    });
    let prefill = t.elapsed();
    let req = StepRequest {
        seq_ids: ids.clone(),
        num_new_tokens: vec![1; SEQS as usize],
        append_indptr: (0..=SEQS as u32).collect(),
        append_tokens: vec![7; SEQS as usize],
    };
    let t = Instant::now();
    for _ in 0..STEPS {
        m.step(&req);
    }
    let per_step = t.elapsed().as_secs_f64() / STEPS as f64;
    println!(
        "one group (every layer full attention): prefill {:.1} ms; decode step {:.1} us ({:.0} ns per seq); blocks held per seq: {} (for all 6 layers)",
        prefill.as_secs_f64() * 1e3,
        per_step * 1e6,
        per_step * 1e9 / SEQS as f64,
        m.block_tables(1).unwrap()[0].len()
    );
}
