//! Replays an allocator operation trace (written by `benchmarks/op_trace.py`) through the core
//! alone, with no Python: the floor that the Python replay (`benchmarks/replay_pagedkv.py`)
//! is compared against.
//!
//! Run: `cargo run --release -p pagedkv-core --example replay -- TRACE.json TOKENS.bin
//! [--repeats N] [--hash-algo sha256|xxh3_128] [--mode manager|pool] [--token-arrays] [--phases]`.
//!
//! Inputs: `TRACE.json` is `OpTrace.save` (per step the requests admitted / finished, prompt and
//! output lengths, pool size, block size, the trace's block-op count); `TOKENS.bin` is
//! `OpTrace.save_tokens`: little-endian `u32` token ids, request by request, the prompt then the
//! output tokens.
//!
//! The calls per step are those of the Python replay (block tables as deltas, no dense copy:
//! [`StepOptions::skip_block_table`], the binding's default; no per-token slot mapping and input
//! ids unless `--token-arrays`: [`StepOptions::skip_token_arrays`], as the Python replay's
//! default): one batched [`KvCacheManager::step`] for
//! the running sequences (one appended token and one slot each), `add_sequence` + one batched
//! `step` for the admitted prompts, `free` for the finished ones. `--mode pool` replays only the
//! block traffic on a bare [`BlockPool`] (`replay_common.run_pool`'s schedule: one allocate per
//! admitted prompt, one batched allocate for the decodes that start a block, one tail-first free
//! per finished request).
//!
//! Prints one JSON object: thread CPU ns per block op (the compared figure, best of the repeats),
//! wall time, µs per step, and the CPU time split into decode steps, admissions and frees (in
//! pool mode only with `--phases`: the extra clock reads cost about as much as a small step's
//! pool work, so by default the pool replay reads the clock at step boundaries only, as the
//! Python replay does, and counts the whole step as frees).

use pagedkv_core::events::EventSink;
use pagedkv_core::pool::BlockPool;
use pagedkv_core::{
    BlockId, CacheConfig, HashAlgo, KvCacheManager, SequenceSpec, StepDrafts, StepOptions,
    StepRequest,
};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// The fields of `OpTrace` the replay needs.
struct Trace {
    block_size: u32,
    num_blocks: u32,
    block_ops: u64,
    prompt_lens: Vec<usize>,
    admit: Vec<Vec<usize>>,
    finish: Vec<Vec<usize>>,
    /// Per request, prompt tokens then output tokens.
    tokens: Vec<Vec<u32>>,
}

fn usizes(v: &Value, key: &str) -> Vec<usize> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("trace field {key} missing"))
        .iter()
        .map(|x| x.as_u64().expect("non-negative int") as usize)
        .collect()
}

fn steps(v: &Value, key: &str) -> Vec<Vec<usize>> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("trace field {key} missing"))
        .iter()
        .map(|s| {
            s.as_array()
                .expect("list of request ids")
                .iter()
                .map(|x| x.as_u64().expect("request id") as usize)
                .collect()
        })
        .collect()
}

fn load(trace_path: &str, tokens_path: &str) -> Trace {
    let v: Value = serde_json::from_str(
        &std::fs::read_to_string(trace_path).unwrap_or_else(|e| panic!("{trace_path}: {e}")),
    )
    .expect("trace JSON");
    let prompt_lens = usizes(&v, "prompt_lens");
    let output_lens = usizes(&v, "output_lens");
    let raw = std::fs::read(tokens_path).unwrap_or_else(|e| panic!("{tokens_path}: {e}"));
    let flat: Vec<u32> = raw
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let total: usize = prompt_lens.iter().sum::<usize>() + output_lens.iter().sum::<usize>();
    assert_eq!(
        flat.len(),
        total,
        "{tokens_path}: token count does not match the trace"
    );
    let mut tokens = Vec::with_capacity(prompt_lens.len());
    let mut at = 0;
    for (p, o) in prompt_lens.iter().zip(&output_lens) {
        tokens.push(flat[at..at + p + o].to_vec());
        at += p + o;
    }
    Trace {
        block_size: v["block_size"].as_u64().expect("block_size") as u32,
        num_blocks: v["num_blocks"].as_u64().expect("num_blocks") as u32,
        block_ops: v["block_ops"].as_u64().expect("block_ops"),
        prompt_lens,
        admit: steps(&v, "admit"),
        finish: steps(&v, "finish"),
        tokens,
    }
}

/// CPU time of the calling thread in ns (the replay is single-threaded; robust on a shared
/// machine, like `time.thread_time_ns` in the Python replays).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec and the clock id is a constant.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU ns of one replay, split by phase, and wall ns.
#[derive(Default, Clone, Copy)]
struct Run {
    decode_ns: u64,
    admit_ns: u64,
    free_ns: u64,
    wall_ns: u64,
    max_step_ns: u64,
}

impl Run {
    fn cpu_ns(&self) -> u64 {
        self.decode_ns + self.admit_ns + self.free_ns
    }
}

fn replay_manager(tr: &Trace, algo: HashAlgo, token_arrays: bool) -> (Run, u64) {
    let mut cfg = CacheConfig::new(tr.num_blocks, tr.block_size);
    cfg.hash_algo = algo;
    let mgr = KvCacheManager::new(cfg).expect("config");
    let mut running: Vec<usize> = Vec::new();
    let mut sampled = vec![0usize; tr.prompt_lens.len()];
    let mut run = Run::default();
    let mut cached_tokens = 0u64;
    // As the Python replay: block tables as deltas only, no dense copy.
    let delta_only = StepOptions {
        skip_block_table: true,
        skip_token_arrays: !token_arrays,
        reserve_blocks: 0,
    };
    let no_drafts = StepDrafts::default();
    let wall = Instant::now();
    for (adm, fin) in tr.admit.iter().zip(&tr.finish) {
        // The step's inputs (batch ids, sampled tokens, prompt lengths) are built before the
        // clock, as the Python replay builds its arrays before it: an engine has them from its
        // scheduler and sampler.
        let n = running.len();
        let decode = StepRequest {
            seq_ids: running.iter().map(|&r| r as u64).collect(),
            num_new_tokens: vec![1; n],
            append_indptr: (0..=n as u32).collect(),
            append_tokens: running
                .iter()
                .map(|&r| tr.tokens[r][tr.prompt_lens[r] + sampled[r]])
                .collect(),
        };
        let prefill = StepRequest {
            seq_ids: adm.iter().map(|&r| r as u64).collect(),
            num_new_tokens: adm.iter().map(|&r| tr.prompt_lens[r] as u32).collect(),
            ..Default::default()
        };
        let c0 = thread_cpu_ns();
        if n > 0 {
            let out = mgr.step_with(&decode, &no_drafts, delta_only);
            assert!(out.error.is_none(), "decode step failed: {:?}", out.error);
        }
        let c1 = thread_cpu_ns();
        if !adm.is_empty() {
            for &r in adm {
                mgr.add_sequence(
                    r as u64,
                    tr.tokens[r][..tr.prompt_lens[r]].to_vec(),
                    SequenceSpec::default(),
                )
                .expect("add_sequence");
            }
            let out = mgr.step_with(&prefill, &no_drafts, delta_only);
            assert!(out.error.is_none(), "prefill step failed: {:?}", out.error);
            cached_tokens += out.num_cached_tokens.iter().map(|&x| x as u64).sum::<u64>();
        }
        let c2 = thread_cpu_ns();
        for &r in fin {
            assert!(mgr.free(r as u64), "request {r} was not registered");
        }
        let c3 = thread_cpu_ns();
        run.decode_ns += c1 - c0;
        run.admit_ns += c2 - c1;
        run.free_ns += c3 - c2;
        run.max_step_ns = run.max_step_ns.max(c3 - c0);
        // Bookkeeping of the replay itself, outside the clock.
        for &r in &running {
            sampled[r] += 1;
        }
        if !fin.is_empty() {
            running.retain(|r| !fin.contains(r));
        }
        running.extend(adm.iter().filter(|r| !fin.contains(r)));
    }
    run.wall_ns = wall.elapsed().as_nanos() as u64;
    mgr.check_invariants().expect("invariants after the replay");
    assert_eq!(mgr.pool().num_used(), 0, "blocks still in use at the end");
    (run, cached_tokens)
}

/// One step of the pool replay: the decoding requests that start a block, the admitted
/// requests with their prompt block counts, the finished requests.
type PoolStep<'a> = (Vec<usize>, Vec<(usize, usize)>, &'a Vec<usize>);

/// `phases`: also read the clock between the decode allocation, the admissions and the frees
/// (each read is a system call that lands inside the step's time); without it the clock is
/// read only at step boundaries, as the Python replay does, and all time counts as frees.
fn replay_pool(tr: &Trace, phases: bool) -> Run {
    let bs = tr.block_size as usize;
    let mut admit_at = vec![0usize; tr.prompt_lens.len()];
    for (t, adm) in tr.admit.iter().enumerate() {
        for &r in adm {
            admit_at[r] = t;
        }
    }
    // The schedule of `replay_common.run_pool`, built before the clock.
    let mut plan: Vec<PoolStep> = Vec::new();
    let mut running: Vec<usize> = Vec::new();
    for t in 0..tr.admit.len() {
        let needs: Vec<usize> = running
            .iter()
            .copied()
            .filter(|&r| (tr.prompt_lens[r] + t - admit_at[r] - 1) % bs == 0)
            .collect();
        let adm = tr.admit[t]
            .iter()
            .map(|&r| (r, tr.prompt_lens[r].div_ceil(bs)))
            .collect();
        let fin = &tr.finish[t];
        running.retain(|r| !fin.contains(r));
        running.extend(tr.admit[t].iter().filter(|r| !fin.contains(r)));
        plan.push((needs, adm, fin));
    }
    let pool = BlockPool::new(tr.num_blocks, Arc::new(EventSink::new(false))).expect("pool");
    let mut held: Vec<Vec<BlockId>> = vec![Vec::new(); tr.prompt_lens.len()];
    let mut run = Run::default();
    let wall = Instant::now();
    for (needs, adm, fin) in &plan {
        let c0 = thread_cpu_ns();
        if !needs.is_empty() {
            let got = pool.allocate(needs.len()).expect("decode blocks");
            for (&r, b) in needs.iter().zip(got) {
                held[r].push(b);
            }
        }
        let c1 = if phases { thread_cpu_ns() } else { c0 };
        for &(r, n) in adm {
            held[r] = pool.allocate(n).expect("prompt blocks");
        }
        let c2 = if phases { thread_cpu_ns() } else { c0 };
        for &r in fin.iter() {
            let mut blocks = std::mem::take(&mut held[r]);
            blocks.reverse();
            pool.free(&blocks).expect("free");
        }
        let c3 = thread_cpu_ns();
        run.decode_ns += c1 - c0;
        run.admit_ns += c2 - c1;
        run.free_ns += c3 - c2;
        run.max_step_ns = run.max_step_ns.max(c3 - c0);
    }
    run.wall_ns = wall.elapsed().as_nanos() as u64;
    assert_eq!(pool.num_used(), 0, "blocks still in use at the end");
    run
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut positional = Vec::new();
    let mut repeats = 5usize;
    let mut algo = HashAlgo::Sha256;
    let mut mode = "manager".to_string();
    let mut phases = false;
    let mut token_arrays = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--repeats" => repeats = it.next().and_then(|v| v.parse().ok()).expect("--repeats N"),
            "--hash-algo" => {
                algo = match it.next().map(String::as_str) {
                    Some("sha256") => HashAlgo::Sha256,
                    Some("xxh3_128") => HashAlgo::Xxh3_128,
                    other => panic!("--hash-algo sha256|xxh3_128, got {other:?}"),
                }
            }
            "--mode" => mode = it.next().expect("--mode manager|pool").clone(),
            "--phases" => phases = true,
            "--token-arrays" => token_arrays = true,
            _ => positional.push(a.clone()),
        }
    }
    let [trace_path, tokens_path] = positional.as_slice() else {
        eprintln!("usage: replay TRACE.json TOKENS.bin [--repeats N] [--hash-algo sha256|xxh3_128] [--mode manager|pool] [--token-arrays] [--phases]");
        std::process::exit(2);
    };
    let tr = load(trace_path, tokens_path);
    let mut runs = Vec::new();
    let mut cached = 0;
    for _ in 0..repeats.max(1) {
        let run = match mode.as_str() {
            "manager" => {
                let (run, c) = replay_manager(&tr, algo, token_arrays);
                cached = c;
                run
            }
            "pool" => replay_pool(&tr, phases),
            m => panic!("--mode manager|pool, got {m}"),
        };
        runs.push(run);
    }
    let best = *runs.iter().min_by_key(|r| r.cpu_ns()).expect("one run");
    let steps = tr.admit.len() as f64;
    let ops = tr.block_ops as f64;
    let out = json!({
        "system": "pagedkv-core (Rust, no Python)",
        "mode": mode,
        "hash": if mode == "pool" { "none (bare pool)" } else { algo.name() },
        "token_arrays": token_arrays,
        "repeats": runs.len(),
        "best": {
            "cpu_total_ns": best.cpu_ns(),
            "ns_per_block_op": best.cpu_ns() as f64 / ops,
            "us_per_step_mean": best.cpu_ns() as f64 / steps / 1e3,
            "us_per_step_max": best.max_step_ns as f64 / 1e3,
            "wall_total_ns": best.wall_ns,
            "wall_ns_per_block_op": best.wall_ns as f64 / ops,
            "decode_ns_per_block_op": best.decode_ns as f64 / ops,
            "admit_ns_per_block_op": best.admit_ns as f64 / ops,
            "free_ns_per_block_op": best.free_ns as f64 / ops,
        },
        "runs_cpu_ns": runs.iter().map(Run::cpu_ns).collect::<Vec<_>>(),
        "counters": {"cached_prompt_tokens": cached},
    });
    println!("{out}");
}
