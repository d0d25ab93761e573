//! One full-attention group: CPU time of one decode step of 256 sequences in steady state
//! (lengths spread over 64..576 tokens at block size 16, a sequence reaching 576 freed and
//! replaced by a 64-token prompt outside the timed region), on the groups manager
//! (`HybridManager` with one group) beside `KvCacheManager`, interleaved so machine load hits
//! both alike. Prints the median µs per step; no timing assertions.
//! Run: `cargo bench -p pagedkv-core --bench one_group`.

use pagedkv_core::{
    CacheConfig, GroupSpec, HybridConfig, HybridManager, HybridStepOptions, KvCacheManager,
    SequenceSpec, StepDrafts, StepOptions, StepRequest,
};
use std::time::Instant;

const BS: u32 = 16;
const SEQS: usize = 256;
const MIN_LEN: usize = 64;
const MAX_LEN: usize = 576;
const STEPS: usize = 4000;

/// The two managers behind one interface: add, schedule, free.
trait Subject {
    fn add(&self, id: u64, prompt: Vec<u32>);
    fn decode(&self, req: &StepRequest);
    fn free(&self, id: u64);
}

impl Subject for KvCacheManager {
    fn add(&self, id: u64, prompt: Vec<u32>) {
        let n = prompt.len() as u32;
        self.add_sequence(id, &prompt, SequenceSpec::default())
            .unwrap();
        let out = self.step(&StepRequest {
            seq_ids: vec![id],
            num_new_tokens: vec![n],
            ..Default::default()
        });
        assert!(out.error.is_none());
    }
    fn decode(&self, req: &StepRequest) {
        let opts = StepOptions {
            skip_block_table: true,
            ..Default::default()
        };
        let out = self.step_with(req, opts);
        assert!(out.error.is_none(), "{:?}", out.error);
    }
    fn free(&self, id: u64) {
        KvCacheManager::free(self, id);
    }
}

impl Subject for HybridManager {
    fn add(&self, id: u64, prompt: Vec<u32>) {
        let n = prompt.len() as u32;
        self.add_sequence(id, prompt, SequenceSpec::default())
            .unwrap();
        let out = self.step(&StepRequest {
            seq_ids: vec![id],
            num_new_tokens: vec![n],
            ..Default::default()
        });
        assert!(out.error.is_none());
    }
    fn decode(&self, req: &StepRequest) {
        let opts = HybridStepOptions {
            skip_block_table: true,
            ..Default::default()
        };
        let out = self.step_with(req, &StepDrafts::default(), opts);
        assert!(out.error.is_none(), "{:?}", out.error);
    }
    fn free(&self, id: u64) {
        HybridManager::free(self, id);
    }
}

/// Steady-state decode: per step one token appended and scheduled for every sequence.
struct Workload<M> {
    m: M,
    ids: Vec<u64>,
    lens: Vec<usize>,
    next_id: u64,
    rng: u64,
    times: Vec<f64>,
}

impl<M: Subject> Workload<M> {
    fn new(m: M) -> Self {
        let mut w = Self {
            m,
            ids: Vec::new(),
            lens: Vec::new(),
            next_id: 0,
            rng: 0x9e37_79b9_7f4a_7c15,
            times: Vec::new(),
        };
        for i in 0..SEQS {
            let n = MIN_LEN + i * (MAX_LEN - 1 - MIN_LEN) / (SEQS - 1);
            let id = w.admit(n);
            w.ids.push(id);
            w.lens.push(n);
        }
        w
    }

    fn token(&mut self) -> u32 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % 32_000) as u32
    }

    fn admit(&mut self, n: usize) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let prompt = (0..n).map(|_| self.token()).collect();
        self.m.add(id, prompt);
        id
    }

    fn step(&mut self) {
        let req = StepRequest {
            seq_ids: self.ids.clone(),
            num_new_tokens: vec![1; SEQS],
            append_indptr: (0..=SEQS as u32).collect(),
            append_tokens: (0..SEQS).map(|_| self.token()).collect(),
        };
        let t = Instant::now();
        self.m.decode(&req);
        self.times.push(t.elapsed().as_secs_f64() * 1e6);
        for i in 0..SEQS {
            self.lens[i] += 1;
            if self.lens[i] >= MAX_LEN {
                self.m.free(self.ids[i]);
                self.ids[i] = self.admit(MIN_LEN);
                self.lens[i] = MIN_LEN;
            }
        }
    }

    fn median(&mut self) -> f64 {
        self.times.sort_by(f64::total_cmp);
        self.times[self.times.len() / 2]
    }
}

fn main() {
    let num_blocks = (SEQS * (MAX_LEN / BS as usize + 2) + 1) as u32;
    let mut one = Workload::new(KvCacheManager::new(CacheConfig::new(num_blocks, BS)).unwrap());
    let cfg = HybridConfig::new(num_blocks, vec![GroupSpec::full(BS, 64)], vec![0]);
    let mut groups = Workload::new(HybridManager::new(cfg).unwrap());
    // PAGEDKV_BENCH_ONLY=one|groups: time only that manager (for `perf stat` of one side).
    let only = std::env::var("PAGEDKV_BENCH_ONLY").unwrap_or_default();
    for _ in 0..STEPS {
        if only != "groups" {
            one.step();
        }
        if only != "one" {
            groups.step();
        }
    }
    if !only.is_empty() {
        let w = if only == "one" {
            &mut one.times
        } else {
            &mut groups.times
        };
        w.sort_by(f64::total_cmp);
        println!("{only}: {:.1} us (median of {STEPS})", w[w.len() / 2]);
        return;
    }
    println!(
        "decode step of {SEQS} seqs, one full-attention group (block tables as deltas): \
         KvCacheManager {:.1} us, HybridManager {:.1} us (median of {STEPS})",
        one.median(),
        groups.median()
    );
}
