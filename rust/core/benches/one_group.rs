//! One full-attention group: CPU time of one decode step of 256 sequences in steady state
//! (lengths spread over 64..576 tokens at block size 16, a sequence reaching 576 freed and
//! replaced by a 64-token prompt outside the timed region), and of one prefill step of 256
//! distinct 512-token prompts on a fresh manager. Prints medians; no timing assertions.
//! Run: `cargo bench -p pagedkv-core --bench one_group`.

use pagedkv_core::{
    CacheConfig, KvCacheManager, SequenceSpec, StepDrafts, StepOptions, StepRequest,
};
use std::time::Instant;

const BS: u32 = 16;
const SEQS: usize = 256;
const MIN_LEN: usize = 64;
const MAX_LEN: usize = 576;
const STEPS: usize = 4000;

/// The manager as the workload drives it: add, schedule, free.
trait Subject {
    /// Registers the prompt only.
    fn register(&self, id: u64, prompt: Vec<u32>);
    /// One step scheduling every listed sequence's whole prompt (the prefill).
    fn prefill(&self, ids: &[u64], len: u32);
    fn add(&self, id: u64, prompt: Vec<u32>);
    fn decode(&self, req: &StepRequest);
    fn free(&self, id: u64);
}

impl Subject for KvCacheManager {
    fn register(&self, id: u64, prompt: Vec<u32>) {
        self.add_sequence(id, prompt, SequenceSpec::default())
            .unwrap();
    }
    fn prefill(&self, ids: &[u64], len: u32) {
        let out = self.step(&StepRequest {
            seq_ids: ids.to_vec(),
            num_new_tokens: vec![len; ids.len()],
            ..Default::default()
        });
        assert!(out.error.is_none());
    }
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
        let opts = StepOptions {
            skip_block_table: true,
            ..Default::default()
        };
        let out = self.step_with(req, &StepDrafts::default(), opts);
        assert!(out.error.is_none(), "{:?}", out.error);
    }
    fn free(&self, id: u64) {
        KvCacheManager::free(self, id);
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

/// Ms of one prefill step of `SEQS` distinct 512-token prompts on a fresh manager.
fn prefill_ms<M: Subject>(make: impl Fn() -> M, round: u32) -> f64 {
    const LEN: u32 = 512;
    let m = make();
    let ids: Vec<u64> = (0..SEQS as u64).collect();
    for &id in &ids {
        let base = (round * 1000 + id as u32) * LEN;
        m.register(id, (base..base + LEN).collect());
    }
    let t = Instant::now();
    m.prefill(&ids, LEN);
    t.elapsed().as_secs_f64() * 1e3
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let num_blocks = (SEQS * (MAX_LEN / BS as usize + 2) + 1) as u32;
    let cfg = CacheConfig::new(num_blocks, BS);
    let make = || KvCacheManager::new(cfg.clone()).unwrap();
    // The first round discarded (the allocator's first touches).
    let prefill: Vec<f64> = (0..12).map(|r| prefill_ms(make, r)).skip(1).collect();
    println!(
        "prefill step of {SEQS} x 512 tokens, one full-attention group: {:.2} ms (median of 11)",
        median(prefill)
    );
    let mut w = Workload::new(make());
    for _ in 0..STEPS {
        w.step();
    }
    println!(
        "decode step of {SEQS} seqs, one full-attention group (block tables as deltas): {:.1} us \
         (median of {STEPS})",
        w.median()
    );
}
