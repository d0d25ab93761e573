"""The engine's cache identity (pagedkv.engine.models.identity): engines that differ in exactly one part
(weights, tokenizer, chat template, adapter, KV dtype, RoPE config) give disjoint block hashes
for the same prompt; engines started separately (another process) on the same files give equal
ones; the weights digest cache; bad input."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.engine import ModelBundle, build_tiny_model

import pagedkv
from pagedkv.engine import EngineConfigError, LLMEngine, SamplingParams
from pagedkv.engine.models.identity import (
    IDENTITY_PARTS,
    CacheIdentity,
    cached_weights_digest,
    source_file_versions,
    tokenizer_digest,
    weights_digest,
)

BLOCK_SIZE = 8
PROMPT = list(range(5, 5 + 4 * BLOCK_SIZE + 3))  # 4 full blocks before the last prompt token


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))


def _engine(model: Any, tokenizer: Any = None, **kw: Any) -> LLMEngine:
    kw = {"num_kv_blocks": 32, "block_size": BLOCK_SIZE, "device": "cpu", "enable_kv_events": True, **kw}
    return LLMEngine(model, tokenizer=tokenizer, **kw)


def stored_hashes(engine: LLMEngine, prompt: list[int] = PROMPT) -> list[bytes]:
    """The block hashes the engine's KV events announce for ``prompt`` (one generated token)."""
    engine.manager.take_events()
    engine.generate([prompt], SamplingParams(max_tokens=1))
    out: list[bytes] = []
    for ev in engine.manager.take_events():
        if isinstance(ev, pagedkv.BlockStored):
            out += ev.block_hashes
    return out


@pytest.fixture(scope="module")
def base_hashes(tiny: ModelBundle) -> list[bytes]:
    hashes = stored_hashes(_engine(tiny.hf, tiny.tokenizer))
    assert len(hashes) == 4
    return hashes


def test_identity_parts_seed_the_hash_chain(tiny):
    e = _engine(tiny.hf, tiny.tokenizer)
    ident = e.cache_identity
    assert tuple(ident.parts) == IDENTITY_PARTS
    assert ident.parts["kv_dtype"] == "float32" and ident.parts["adapter"] == "none"
    assert json.loads(ident.parts["rope"]) == {"rope_theta": 10000.0, "rope_type": "default"}
    assert ident.parts["weights"] == weights_digest(tiny.hf)
    assert ident.parts["tokenizer"] == tokenizer_digest(tiny.tokenizer)
    assert e.manager.config.hash_seed == ident.seed == bytes.fromhex(ident.digest)
    assert len(ident.seed) == 32
    d = ident.as_dict()
    assert d["digest"] == ident.digest and d["parts"] == dict(ident.parts)
    assert ident.describe().startswith(ident.digest[:16])
    # The seed is what makes the hashes: an indexer with it computes the engine's hashes.
    ix = pagedkv.KVIndexer(BLOCK_SIZE, hash_seed=ident.seed)
    assert ix.block_hashes(PROMPT, num_blocks=4) == stored_hashes(e)
    assert pagedkv.KVIndexer(BLOCK_SIZE).block_hashes(PROMPT, num_blocks=4) != stored_hashes(e)


def test_same_model_twice_in_one_process_gives_equal_hashes(tiny, base_hashes):
    assert stored_hashes(_engine(tiny.hf, tiny.tokenizer)) == base_hashes


def _perturbed_weights(tiny: ModelBundle) -> Any:
    hf = copy.deepcopy(tiny.hf)
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3  # one weight of one layer
    return hf


def _lora_merged(tiny: ModelBundle) -> Any:
    """The model with a rank-1 LoRA delta ``B @ A`` merged into layer 0's k projection."""
    hf = copy.deepcopy(tiny.hf)
    w = hf.model.layers[0].self_attn.k_proj.weight
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(1, w.shape[1], generator=g), torch.randn(w.shape[0], 1, generator=g)
    with torch.no_grad():
        w += 0.01 * (b @ a)
    return hf


def _other_tokenizer(tiny: ModelBundle) -> Any:
    tok = copy.deepcopy(tiny.tokenizer)
    tok.add_tokens(["zzz"])  # the same ids for every token of the prompt, one more entry
    return tok


def _other_template(tiny: ModelBundle) -> Any:
    tok = copy.deepcopy(tiny.tokenizer)
    tok.chat_template = "{% for m in messages %}w6 {{ m['content'] }} w7 {% endfor %}w5"
    return tok


@pytest.mark.parametrize("part", ["weights", "adapter", "tokenizer", "chat_template", "kv_dtype", "rope"])
def test_engines_differing_in_one_part_share_no_block_hash(tiny, base_hashes, part, tmp_path):
    base = _engine(tiny.hf, tiny.tokenizer).cache_identity
    if part == "weights":
        other = _engine(_perturbed_weights(tiny), tiny.tokenizer)
    elif part == "adapter":  # the reference engine serves adapters merged into its weights
        other = _engine(_lora_merged(tiny), tiny.tokenizer)
    elif part == "tokenizer":
        other = _engine(tiny.hf, _other_tokenizer(tiny))
    elif part == "chat_template":
        other = _engine(tiny.hf, _other_template(tiny))
    elif part == "kv_dtype":
        other = _engine(tiny.hf, tiny.tokenizer, dtype=torch.bfloat16)
    else:  # same weights, linear RoPE scaling
        scaled = build_tiny_model(tmp_path / "linear", rope_parameters=dict(rope_type="linear", factor=2.0))
        other = _engine(scaled.hf, scaled.tokenizer)
    changed = {k for k in IDENTITY_PARTS if other.cache_identity.parts[k] != base.parts[k]}
    # Exactly the part under test; the config is digested with the weights, and the weights as
    # the engine computes with them (cast to its dtype).
    want = {"adapter": {"weights"}, "rope": {"weights", "rope"}, "kv_dtype": {"weights", "kv_dtype"}}.get(part, {part})
    assert changed == want
    hashes = stored_hashes(other)
    assert len(hashes) == len(base_hashes) == 4
    assert not set(hashes) & set(base_hashes)


def test_adapter_part_changes_the_digest(tiny):
    base = _engine(tiny.hf, tiny.tokenizer).cache_identity
    with_adapter = CacheIdentity({**base.parts, "adapter": "sha256-of-some-lora"})
    assert with_adapter.digest != base.digest and len(with_adapter.seed) == 32


_CHILD = """
import json, sys
import pagedkv
from pagedkv.engine import LLMEngine, SamplingParams
e = LLMEngine(sys.argv[1], num_kv_blocks=32, block_size={bs}, device="cpu", enable_kv_events=True)
e.generate([{prompt}], SamplingParams(max_tokens=1))
hashes = [h.hex() for ev in e.manager.take_events() if isinstance(ev, pagedkv.BlockStored) for h in ev.block_hashes]
print(json.dumps({{"digest": e.cache_identity.digest, "hashes": hashes}}))
"""


@pytest.mark.slow
def test_engines_started_separately_on_the_same_files_agree(tiny, base_hashes):
    """Another process loads the same model folder: same identity, same block hashes as this
    process's engine (built from the folder, and from the already loaded model)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = _CHILD.format(bs=BLOCK_SIZE, prompt=PROMPT)
    run = subprocess.run(
        [sys.executable, "-c", child, str(tiny.path)], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    mine = _engine(str(tiny.path))
    assert theirs["digest"] == mine.cache_identity.digest == _engine(tiny.hf, tiny.tokenizer).cache_identity.digest
    assert [bytes.fromhex(h) for h in theirs["hashes"]] == stored_hashes(mine) == base_hashes


def test_weights_digest_cache_is_keyed_by_the_files(tiny, tmp_path, monkeypatch):
    import pagedkv.engine.models.identity as identity

    folder = tmp_path / "model"
    bundle = build_tiny_model(folder)
    calls: list[int] = []
    real = identity.weights_digest

    def counting(hf: Any, dtype: Any = None) -> str:
        calls.append(1)
        return real(hf, dtype)

    monkeypatch.setattr(identity, "weights_digest", counting)
    first = cached_weights_digest(bundle.hf, folder, torch.float32)
    assert first == real(bundle.hf) and len(calls) == 1
    assert cached_weights_digest(bundle.hf, folder, torch.float32) == first and len(calls) == 1  # from the cache
    cached_weights_digest(bundle.hf, folder, torch.bfloat16)  # another dtype: another entry
    assert len(calls) == 2
    assert len(list((tmp_path / "cache" / "weights-digests").iterdir())) == 2
    entry = identity._digest_cache_file(identity.source_file_versions(folder) or [], torch.float32)
    assert json.loads(entry.read_text())["weights"] == first
    entry.write_text("not json")  # a damaged entry is recomputed, not trusted
    assert cached_weights_digest(bundle.hf, folder, torch.float32) == first and len(calls) == 3
    entry.write_text(json.dumps({"weights": "z" * 64, "files": []}))  # right length, not a digest
    assert cached_weights_digest(bundle.hf, folder, torch.float32) == first and len(calls) == 4
    st = (folder / "model.safetensors").stat()
    os.utime(folder / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    cached_weights_digest(bundle.hf, folder, torch.float32)  # a touched file: recomputed
    assert len(calls) == 5
    # Entries of models whose files are gone are dropped at the next write.
    gone = build_tiny_model(tmp_path / "gone")
    cached_weights_digest(gone.hf, tmp_path / "gone", torch.float32)
    entries = tmp_path / "cache" / "weights-digests"
    assert len(list(entries.iterdir())) == 4
    for f in (tmp_path / "gone").iterdir():
        f.unlink()
    cached_weights_digest(bundle.hf, folder, torch.float16)
    kept = [json.loads(e.read_text())["files"] for e in entries.iterdir()]
    assert len(kept) == 4 and all(str(tmp_path / "gone") not in f[0] for f in kept)


def test_a_checkpoint_rewritten_in_place_with_size_and_mtime_kept_gets_a_new_digest(tmp_path):
    """``cp -p`` / ``tar x`` / a reproducible build rewrite a weights file and restore its
    mtime; the size is the same for the same architecture. The cached digest of the old
    weights must not be served for the new ones (the two models would share block hashes)."""
    from safetensors.torch import save_model

    folder = tmp_path / "model"
    old = build_tiny_model(folder)
    old_digest = cached_weights_digest(old.hf, folder, torch.float32)
    new_hf = copy.deepcopy(old.hf)
    with torch.no_grad():
        next(new_hf.parameters()).add_(1.0)  # another checkpoint of the same shapes
    save_model(new_hf, str(tmp_path / "new.safetensors"))
    target = folder / "model.safetensors"
    before = target.stat()
    data = (tmp_path / "new.safetensors").read_bytes()
    assert len(data) == before.st_size and data != target.read_bytes()
    with open(target, "r+b") as f:  # in place: same inode, same size
        f.write(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = target.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    new_digest = cached_weights_digest(new_hf, folder, torch.float32)
    assert new_digest == weights_digest(new_hf, torch.float32) != old_digest


def test_a_checkpoint_rewritten_during_the_load_is_not_cached_under_its_new_version(tmp_path):
    """The file versions are taken before the load. If a file changed while the model was
    loading, the loaded weights may be the old ones: their digest must not be stored under
    the new file's version, or the next engine loading the new weights would be served the
    old digest (two models sharing block hashes)."""
    folder = tmp_path / "model"
    old = build_tiny_model(folder)
    versions = source_file_versions(folder)
    assert versions is not None
    target = folder / "model.safetensors"
    before = target.stat()
    data = target.read_bytes()
    with open(target, "r+b") as f:  # a rewrite during the load (same bytes, moved ctime)
        f.write(data)
    os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    while target.stat().st_ctime_ns == before.st_ctime_ns:  # coarse kernel clock: wait a tick
        os.utime(target, ns=(before.st_atime_ns, before.st_mtime_ns))
    entries = tmp_path / "cache" / "weights-digests"
    digest = cached_weights_digest(old.hf, folder, torch.float32, versions)
    assert digest == weights_digest(old.hf, torch.float32)
    assert not entries.exists() or not any(entries.iterdir())  # nothing stored
    # Unchanged during the load: stored as before.
    cached_weights_digest(old.hf, folder, torch.float32, source_file_versions(folder))
    assert len(list(entries.iterdir())) == 1


def test_bad_identity_input_is_a_typed_error(tiny):
    good = dict(_engine(tiny.hf, tiny.tokenizer).cache_identity.parts)
    for bad in ({k: v for k, v in good.items() if k != "tokenizer"}, {**good, "device": "cpu"}, {**good, "rope": ""}):
        with pytest.raises(EngineConfigError) as ei:
            CacheIdentity(bad)
        assert isinstance(ei.value, pagedkv.PagedKVError)
    with pytest.raises(EngineConfigError, match="cache identity parts"):
        CacheIdentity("weights")  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="state_dict"):
        weights_digest(object())
    with pytest.raises(EngineConfigError, match="tokenizer=object"):
        tokenizer_digest(object())


def test_tokenizer_digest_ignores_padding_and_truncation_state(tiny):
    """transformers leaves padding / truncation switched on in the backend after a call that
    asks for them; that is call-time state, not the text -> ids map, so an engine built after
    such a call has the same identity (and the caller's tokenizer keeps its state)."""
    tok = copy.deepcopy(tiny.tokenizer)
    clean = tokenizer_digest(tok)
    assert tok.backend_tokenizer.padding is None and tok.backend_tokenizer.truncation is None
    tok(["w7 w8", "w9"], padding=True, truncation=True, max_length=2)
    assert tok.backend_tokenizer.padding is not None and tok.backend_tokenizer.truncation is not None
    assert tokenizer_digest(tok) == clean
    assert tok.backend_tokenizer.padding is not None and tok.backend_tokenizer.truncation["max_length"] == 2
    base = _engine(tiny.hf, tiny.tokenizer).cache_identity.digest
    assert _engine(tiny.hf, tok).cache_identity.digest == base


def test_a_loaded_model_served_at_another_dtype_matches_the_files_loaded_at_it(tiny):
    """The weights are digested as the engine computes with them: the fp32 model object served
    at bf16 and the same files loaded at bf16 have one identity and the same block hashes."""
    from_files = _engine(str(tiny.path), dtype=torch.bfloat16)
    from_object = _engine(tiny.hf, tiny.tokenizer, dtype="bfloat16")
    assert next(iter(tiny.hf.parameters())).dtype == torch.float32  # the caller's model is not cast
    assert from_object.cache_identity.digest == from_files.cache_identity.digest
    assert from_object.cache_identity.parts["weights"] == weights_digest(tiny.hf, torch.bfloat16)
    assert weights_digest(tiny.hf, torch.bfloat16) != weights_digest(tiny.hf) == weights_digest(tiny.hf, "float32")
    assert stored_hashes(from_object) == stored_hashes(from_files)
    with pytest.raises(EngineConfigError, match="dtype"):
        weights_digest(tiny.hf, "int8")


def test_a_replica_snapshot_names_its_root_and_a_foreign_indexer_refuses_it(tiny):
    """After a gap a router re-reads a replica's whole cache with ``snapshot()``: the snapshot
    carries the replica's hash root, which the router's indexer checks like a batch's."""
    pytest.importorskip("msgspec")
    from pagedkv.cluster.replica import EngineReplica

    replica = EngineReplica(0, str(tiny.path), {"num_kv_blocks": 32, "block_size": 4, "device": "cpu"}, None)
    replica.run([("r0", PROMPT, SamplingParams(max_tokens=2), False, None)], max_steps=8)
    seq, hashes, root = replica.snapshot()
    info = replica.info()
    scheme = info["hash_scheme"]
    assert scheme == pagedkv.HashScheme(4, "sha256", replica.engine.cache_identity.seed)
    own = scheme.indexer()
    assert hashes and root == own.hash_root
    own.apply_snapshot(0, seq, hashes, hash_root=root)
    assert own.worker_hashes(0) == sorted(hashes)
    foreign = dataclasses.replace(scheme, hash_seed=b"another model").indexer()
    with pytest.raises(pagedkv.InvalidArgumentError, match="hash root"):
        foreign.apply_snapshot(0, seq, hashes, hash_root=root)
    assert foreign.worker_status(0) is None
