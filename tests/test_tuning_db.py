"""The tuning database: files, merging, bad files, concurrent writers, every lookup fallback, the hot-path cache."""

from __future__ import annotations

import dataclasses
import json
import logging
import multiprocessing as mp

import pytest
import torch

from flce_compile.plan import tuning_db
from flce_compile.plan.choose import choose_config, resolve_config
from flce_compile.plan.config import FLCEConfig, config_overrides
from flce_compile.tuning import db


def entry(device="h200", vocab=151936, hidden=4096, dtype="bf16", tokens=16384, chunk=2048, ms=10.0, **kw) -> db.Entry:
    return db.Entry(device=device, vocab=vocab, hidden=hidden, dtype=dtype, tokens=tokens,
                    config=FLCEConfig(strategy="triton", chunk_tokens=chunk, block_v=8192, num_warps=8),
                    ms=ms, peak_gb=1.5, default_ms=ms * 1.5, default_peak_gb=1.0, trials=12,
                    torch="2.x", triton="3.x", date="2025-01-01T00:00:00+00:00", **kw)


@pytest.fixture
def dbs(tmp_path, monkeypatch):
    """An empty user DB file and an empty shipped directory, both private to the test."""
    user = tmp_path / "user" / "tuning_db.json"
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setenv(db.ENV_USER_DB, str(user))
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(shipped))
    db.invalidate_cache()
    yield user, shipped
    db.invalidate_cache()


def find(tokens=16384, vocab=151936, hidden=4096, dtype=torch.bfloat16, device="NVIDIA H200"):
    return db.lookup(vocab=vocab, hidden=hidden, dtype=dtype, tokens=tokens, device=device)


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200"), ("H200 SXM 141GB", "h200"), ("h200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100"), ("NVIDIA H100 NVL", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-PCIE-40GB", "a100"), ("NVIDIA GH200 480GB", "gh200"),
    ("NVIDIA H20", "h20"), ("NVIDIA L40S", "l40s"), ("NVIDIA A10G", "a10g"), ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA B200", "b200"), ("AMD Instinct MI300X", "mi300x"), ("NVIDIA GeForce RTX 4090", "rtx_4090"),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "h100_mig"),
])
def test_device_names(name, key):
    assert db.normalize_device_name(name) == key


def test_helpers():
    assert [db.token_bucket(t) for t in (1, 3, 4096, 5000, 6000, 16384, 23000)] == [1, 4, 4096, 4096, 8192, 16384, 16384]
    assert db.normalize_dtype(torch.bfloat16) == "bf16" and db.normalize_dtype("float16") == "fp16"
    with pytest.raises(ValueError, match="dtype"):
        db.normalize_dtype(torch.int8)
    with pytest.raises(ValueError, match="tokens"):
        db.token_bucket(0)
    assert db.device_key(torch.device("cpu")) == "cpu"


def test_round_trip_merge_and_replace(dbs):
    user, _ = dbs
    e1 = entry(tokens=8192)
    db.write_entries(user, [e1, entry(tokens=16384)])
    data = json.loads(user.read_text())
    # plain entries only: the version every reader understands (2 is for files with budget tiers)
    assert data["format"] == db.FORMAT and data["schema_version"] == db.PLAIN_SCHEMA_VERSION == 1
    assert db.read_file(user, strict=True)[0] == e1
    # merge: same key replaced, new key added, others kept
    db.write_entries(user, [entry(tokens=8192, ms=5.0), entry(vocab=32000, hidden=1024)])
    got = {e.key: e for e in db.read_file(user, strict=True)}
    assert len(got) == 3 and got[e1.key].ms == 5.0
    db.write_entries(user, [e1], replace=True)
    assert db.read_file(user, strict=True) == [e1]
    # unknown extra fields survive a round trip (forward-compatible within a schema version)
    e_extra = entry(tokens=4096, extra={"device_name": "NVIDIA H200", "note": "x"})
    db.write_entries(user, [e_extra])
    assert {e.key: e for e in db.read_file(user)}[e_extra.key].extra["note"] == "x"
    assert not list(user.parent.glob("*.tmp"))  # no temporaries left behind


def test_bad_files_are_reported_once_and_ignored(dbs, caplog):
    user, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry()])
    caplog.set_level(logging.WARNING, logger="flce_compile")
    for content in ("{not json", json.dumps({"something": "else"}),
                    json.dumps({"format": db.FORMAT, "schema_version": db.SCHEMA_VERSION + 1, "entries": []})):
        user.parent.mkdir(parents=True, exist_ok=True)
        user.write_text(content)
        db.invalidate_cache()
        caplog.clear()
        for _ in range(3):
            assert find() == (entry().config, "tuning_db:shipped_exact")  # shipped still answers
            db.invalidate_cache()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        with pytest.raises(db.DBFileError):
            db.read_file(user, strict=True)
    # a newer-schema or foreign file is never overwritten ...
    with pytest.raises(db.DBFileError, match="refusing"):
        db.write_entries(user, [entry()])
    # ... a corrupt one is moved aside
    user.write_text("{not json")
    db.write_entries(user, [entry()])
    assert user.with_name(user.name + ".corrupt").read_text() == "{not json"
    assert db.read_file(user, strict=True) == [entry()]
    # a malformed entry is skipped, the others are used
    good = entry(tokens=4096).to_dict()
    user.write_text(json.dumps({"format": db.FORMAT, "schema_version": 1,
                                "entries": [{"vocab": "x"}, {**good, "config": {"bogus": 1}}, good]}))
    assert db.read_file(user) == [entry(tokens=4096)]
    # entries a lookup must never hand out: a config the GPU cannot launch (Triton's "out of resource: threads"
    # in the user's training call), fp32 logits (the caller's precision choice, never tuned), fields of the
    # wrong type that a lenient reading would round or coerce
    bad = [{**good, "config": {**good["config"], "num_warps": 64}},
           {**good, "config": {**good["config"], "fp32_logits": True}},
           {**good, "vocab": 151936.7}, {**good, "tokens": 4096.0}, {**good, "ms": True}, {**good, "device": 5},
           {**good, "config": "triton"}]
    user.write_text(json.dumps({"format": db.FORMAT, "schema_version": 1, "entries": bad + [good]}))
    assert db.read_file(user) == [entry(tokens=4096)]
    for data in bad:
        with pytest.raises((ValueError, TypeError)):
            db.Entry.from_dict(data)
    # a key twice (a hand edit): the last is used, and the file's problems say so
    user.write_text(json.dumps({"format": db.FORMAT, "schema_version": 1, "entries": [good, {**good, "ms": 2.0}]}))
    assert db.read_file(user) == [dataclasses.replace(entry(tokens=4096), ms=2.0)]
    assert db.parse_file(user)[1] == ["entry 0: the same GPU kind, V, H, dtype, token bucket and tier as entry 1, "
                                      "which is used instead"]


def _writer(args):
    path, worker = args
    import flce_compile.tuning.db as dbm

    for i in range(8):
        dbm.write_entries(path, [entry(vocab=1000 + worker, tokens=2 ** (8 + i), ms=1.0 + i)])
    return worker


def test_concurrent_writers(tmp_path):
    path = tmp_path / "concurrent.json"
    ctx = mp.get_context("spawn")
    with ctx.Pool(6) as pool:
        assert sorted(pool.map(_writer, [(str(path), w) for w in range(6)])) == list(range(6))
    entries = db.read_file(path, strict=True)
    assert len(entries) == 6 * 8
    assert {(e.vocab, e.tokens) for e in entries} == {(1000 + w, 2 ** (8 + i)) for w in range(6) for i in range(8)}


def test_lookup_fallbacks(dbs, caplog):
    user, shipped = dbs
    caplog.set_level(logging.DEBUG, logger="flce_compile")
    assert find() is None  # empty: heuristic
    db.write_entries(shipped / "h200.json", [entry(chunk=1024), entry(tokens=4096, chunk=256),
                                             entry(vocab=128256, hidden=4096, chunk=4096, tokens=8192)])
    assert find() == (entry(chunk=1024).config, "tuning_db:shipped_exact")
    assert "tuning_db:shipped_exact" in caplog.text  # the source shows in the debug log
    for name in ("NVIDIA H200 NVL", "H200 SXM 141GB", torch.device("cpu")):
        if isinstance(name, str):
            assert find(device=name)[1] == "tuning_db:shipped_exact"
    # user exact overrides shipped exact
    db.write_entries(user, [entry(chunk=512)])
    assert find() == (entry(chunk=512).config, "tuning_db:user_exact")
    # 20000 tokens -> bucket 16384 (exact); 2000 -> bucket 2048: nearest bucket (4096), same shape
    assert find(tokens=20000)[1] == "tuning_db:user_exact"
    cfg, src = find(tokens=2000)
    assert src == "tuning_db:nearest_tokens(shipped tokens=4096)" and cfg.chunk_tokens == 256
    # 8192 is as far from 4096 as from 16384: the user entry wins the tie
    assert find(tokens=8192)[1] == "tuning_db:nearest_tokens(user tokens=16384)"
    cfg, src = find(tokens=65536)
    assert src == "tuning_db:nearest_tokens(user tokens=16384)"
    # nearest (V, H) on the same GPU: V=131072 H=4096 borrows V=128256's config, chunk kept (a 2% larger V
    # once halved it: the chunk was rounded down to a power of two)
    cfg, src = find(vocab=131072, tokens=8192)
    assert src.startswith("tuning_db:nearest_shape(") and "V=128256" in src and cfg.chunk_tokens == 4096
    # a much larger vocab borrows with a smaller chunk (about the measured logits memory)
    cfg, src = find(vocab=262144, hidden=4096, tokens=8192)
    assert src.startswith("tuning_db:nearest_shape(user V=151936") and cfg.chunk_tokens == 256  # from 512
    # too far away, a GPU of another family (or a MIG slice), or another itemsize: heuristic
    assert find(vocab=2000, hidden=128) is None
    assert find(device="NVIDIA A100-SXM4-80GB") is None
    assert find(device="NVIDIA H100 80GB HBM3 MIG 1g.10gb") is None
    assert find(dtype=torch.float32) is None
    # fp16 borrows from bf16 (same itemsize) as a nearest-shape answer
    assert find(dtype=torch.float16)[1].startswith("tuning_db:nearest_shape(")


H100 = "NVIDIA H100 80GB HBM3"


def test_a_gpu_without_entries_borrows_its_familys(dbs, monkeypatch):
    """An H100 (no entries of its own) runs the H200's configs, saying so. Where both have an answer, the closer
    one wins (exact, then nearest bucket, then nearest shape), the GPU's own among equally close ones."""
    user, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry(chunk=1024), entry(vocab=128256, chunk=4096, tokens=8192)])
    borrowed = entry(chunk=1024).config, "tuning_db:shipped_exact (borrowed from h200)"
    for name in (H100, "NVIDIA H100 PCIe", "NVIDIA H800", "NVIDIA GH200 480GB"):
        assert find(device=name) == borrowed, name
    match = db.find_match(vocab=151936, hidden=4096, dtype="bf16", tokens=16384, device=H100)
    assert (match.kind, match.borrowed_from, match.entry.device) == ("shipped exact", "h200", "h200")
    # the family's other fallbacks too: its nearest bucket, its nearest shape (chunk rescaled as for its own GPU)
    assert find(tokens=2000, device=H100)[1] == "tuning_db:nearest_tokens(shipped tokens=16384) (borrowed from h200)"
    cfg, src = find(vocab=262144, tokens=16384, device=H100)
    assert src.startswith("tuning_db:nearest_shape(shipped V=151936") and src.endswith("(borrowed from h200)")
    assert cfg.chunk_tokens == 512  # 1024 at V=151936, about the same logits memory at V=262144
    # not outside the family, nor for a MIG slice; nothing near in the family: the heuristic
    for name in ("NVIDIA A100-SXM4-80GB", "NVIDIA H20", "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "NVIDIA B200"):
        assert find(device=name) is None, name
    assert find(vocab=2000, hidden=128, device=H100) is None
    # a family is its kinds alone: with an Ampere family beside Hopper, an A100 entry serves an A800, not an H100
    monkeypatch.setitem(tuning_db.GPU_FAMILIES, "a100", "ampere")
    monkeypatch.setitem(tuning_db.GPU_FAMILIES, "a800", "ampere")
    db.write_entries(shipped / "a100.json", [entry(device="a100", vocab=32000, hidden=512, chunk=256)])
    small = {"vocab": 32000, "hidden": 512}  # far from every H200 entry's shape
    assert find(**small, device="NVIDIA A800-SXM4-80GB")[1] == "tuning_db:shipped_exact (borrowed from a100)"
    assert find(**small, device=H100) is None
    # the H100's own exact entry wins; its nearest bucket loses to the family's exact entry but beats the family's
    # nearest bucket; its nearest shape loses to the family's exact entry but beats the family's nearest shape
    db.write_entries(user, [entry(device="h100", tokens=4096, chunk=256)])
    assert find(device=H100) == borrowed
    assert find(tokens=2000, device=H100) == (entry(chunk=256).config, "tuning_db:nearest_tokens(user tokens=4096)")
    db.write_entries(user, [entry(device="h100", chunk=512)])
    assert find(device=H100) == (entry(chunk=512).config, "tuning_db:user_exact")
    user.unlink()
    db.write_entries(user, [entry(device="h100", vocab=131072, chunk=2048)])
    assert find(device=H100) == borrowed
    cfg, src = find(vocab=140000, device=H100)
    assert src.startswith("tuning_db:nearest_shape(user V=131072") and "borrowed" not in src
    # between two answers of one kind of closeness the nearer wins: the H100's own entry at another shape was
    # taken over the H200's much nearer one (V=32000 H=4096: 32768 x 4096 against the H100's 32064 x 3072)
    db.write_entries(shipped / "h200.json", [entry(vocab=32768, hidden=4096, chunk=8192, tokens=16384)])
    db.write_entries(user, [entry(device="h100", vocab=32064, hidden=3072, chunk=4096, tokens=65536)])
    cfg, src = find(vocab=32000, hidden=4096, device=H100)
    assert src.startswith("tuning_db:nearest_shape(shipped V=32768 H=4096") and src.endswith("(borrowed from h200)")
    cfg, src = find(vocab=32000, hidden=3072, tokens=65536, device=H100)
    assert src.startswith("tuning_db:nearest_shape(user V=32064 H=3072") and "borrowed" not in src
    # and between two nearest buckets: the H200's 16384 over the H100's 65536 for an 8192-token call at 32064 x 3072
    # (equally near, at 32768 tokens: the GPU's own)
    db.write_entries(shipped / "h200.json", [entry(vocab=32064, hidden=3072, chunk=8192, tokens=16384)])
    assert find(vocab=32064, hidden=3072, tokens=8192, device=H100)[1] == (
        "tuning_db:nearest_tokens(shipped tokens=16384) (borrowed from h200)")
    assert find(vocab=32064, hidden=3072, tokens=32768, device=H100)[1] == "tuning_db:nearest_tokens(user tokens=65536)"
    db.write_entries(user, [entry(device="h100", vocab=131072, chunk=2048)], replace=True)
    (shipped / "h200.json").unlink()
    db.write_entries(shipped / "h200.json", [entry(chunk=1024), entry(vocab=128256, chunk=4096, tokens=8192)])
    # the family is every kind of it, the closest answer first: a GH200's nearest shape does not hide the H200's
    # exact entry; between equally close answers, the first kind by name; and the H200 borrows the H100's too
    db.write_entries(user, [entry(device="gh200", vocab=131072, chunk=2048)])
    assert find(device=H100) == borrowed
    db.write_entries(user, [entry(device="gh200", chunk=256)])
    assert find(device=H100) == (entry(chunk=256).config, "tuning_db:user_exact (borrowed from gh200)")
    assert find(device="NVIDIA H200")[1] == "tuning_db:shipped_exact"  # its own before the family's
    db.write_entries(user, [entry(device="h100", vocab=50257, hidden=768, chunk=4096)])
    assert find(vocab=50257, hidden=768, device="NVIDIA H200")[1] == "tuning_db:user_exact (borrowed from h100)"


def test_lookup_cache_and_invalidation(dbs, monkeypatch):
    user, _ = dbs
    monkeypatch.setattr(tuning_db, "_clock", lambda: 1000.0)  # time stands still: no re-validation by mtime
    db.write_entries(user, [entry(chunk=512)])
    assert find()[0].chunk_tokens == 512
    # an edit behind the DB's back is not seen until the cache is invalidated (or RECHECK_S has passed) ...
    user.write_text(db._dump([entry(chunk=4096)]))
    assert find()[0].chunk_tokens == 512
    db.invalidate_cache()
    assert find()[0].chunk_tokens == 4096
    # ... while write_entries invalidates by itself
    db.write_entries(user, [entry(chunk=1024)])
    assert find()[0].chunk_tokens == 1024
    # hot path: memoised lookups, which neither read the files again nor search the index again
    reads, searches = [], []
    real_parse, real_lookup = tuning_db.parse_file, tuning_db._lookup_uncached
    monkeypatch.setattr(tuning_db, "parse_file", lambda *a, **k: reads.append(a) or real_parse(*a, **k))
    monkeypatch.setattr(tuning_db, "_lookup_uncached", lambda *a, **k: searches.append(a) or real_lookup(*a, **k))
    for t in range(2000):
        find(tokens=16384 + (t % 64))
    assert reads == [] and len(searches) <= 1  # (tokens 16384-16447 share one bucket)


def test_lookup_never_raises(dbs, monkeypatch):
    monkeypatch.setattr(tuning_db, "_get_index", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert find() is None
    assert find(dtype="int4") is None


def test_choose_config_uses_the_db(dbs, monkeypatch):
    user, _ = dbs
    db.write_entries(user, [entry(chunk=512)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    config, source = choose_config(16384, 151936, 4096, torch.bfloat16, torch.device("cuda"))
    assert (config, source) == (entry(chunk=512).config, "tuning_db:user_exact")
    config, source = choose_config(16384, 999, 64, torch.bfloat16, torch.device("cuda"))
    assert source == "heuristic"


def test_partial_config_overrides_the_chosen_one(dbs, monkeypatch):
    """A dict of some fields forces only those: the rest still comes from the DB (here: a Triton config)."""
    user, _ = dbs
    db.write_entries(user, [entry(chunk=512)])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    overrides = config_overrides({"chunk_tokens": 1024})
    config, source = resolve_config(overrides, 16384, 151936, 4096, torch.bfloat16, torch.device("cuda"))
    assert config == dataclasses.replace(entry(chunk=512).config, chunk_tokens=1024)
    assert source == "tuning_db:user_exact, forced chunk_tokens"
    full = FLCEConfig(strategy="torch", chunk_tokens=64)
    assert resolve_config(config_overrides(full), 16384, 151936, 4096, torch.bfloat16, torch.device("cuda")) == (
        full, "forced")
    assert config_overrides("") is None and config_overrides({}) is None
    with pytest.raises(ValueError, match="power of two"):
        config_overrides({"num_warps": 3})
    with pytest.raises(TypeError, match="config must be"):
        config_overrides(7)


def test_rescaled_chunk_stays_on_the_tuning_grid():
    """A borrowed chunk is rescaled to the grid the tuner searches (powers of two and 1.5x steps), keeping the
    logits chunk (chunk x V) at most RESCALE_TOLERANCE larger than the measured one."""
    cfg = FLCEConfig(strategy="triton", chunk_tokens=3072)
    assert tuning_db._at_vocab(cfg, 151936, 151936, "bf16") is cfg
    assert tuning_db._at_vocab(cfg, 151936, 152064, "bf16").chunk_tokens == 3072  # 0.1% larger V: kept
    assert tuning_db._at_vocab(cfg, 151936, 262144, "bf16").chunk_tokens == 1536  # 1781 tokens of logits -> grid 1536
    assert tuning_db._at_vocab(cfg, 151936, 75968, "bf16").chunk_tokens == 6144  # half the V: twice the chunk
    for from_v, to_v in ((128256, 131072), (151936, 262144), (32000, 50257), (256000, 128256)):
        for chunk in (1024, 1536, 2048, 3072, 8192):
            got = tuning_db._at_vocab(FLCEConfig(chunk_tokens=chunk), from_v, to_v, "bf16").chunk_tokens
            assert got * to_v <= chunk * from_v * (1 + db.RESCALE_TOLERANCE)
            low = 1 << (got.bit_length() - 1)
            assert got in (low, 3 * low // 2)


def test_a_borrowed_config_pads_an_odd_vocab_as_the_heuristic_does(dbs):
    """An entry at an aligned V (128256) holds pad_vocab=False, a no-op there. Borrowed by a call at an odd V (128257:
    a pad token added) it left the GEMMs unaligned (3.2x slower at GPT-2's shape); the call now pads, as the
    heuristic would. An entry measured at an odd V keeps its own choice; an aligned V never pads."""
    user, shipped = dbs
    db.write_entries(shipped / "h200.json", [entry(vocab=128256, chunk=4096, tokens=8192),
                                             entry(vocab=50257, hidden=768, chunk=4096, tokens=8192)])
    for vocab, hidden, pad, near in ((128257, 4096, True, 128256), (151655, 4096, True, 128256),
                                     (131072, 4096, False, 128256), (50280, 768, False, 50257),
                                     (50263, 768, False, 50257)):
        cfg, src = find(vocab=vocab, hidden=hidden, tokens=8192)
        assert f"nearest_shape(shipped V={near} " in src and cfg.pad_vocab is pad, (vocab, cfg, src)
    padded = FLCEConfig(strategy="triton", chunk_tokens=4096, pad_vocab=True)
    db.write_entries(shipped / "h200.json",
                     [dataclasses.replace(entry(vocab=50257, hidden=768, chunk=4096, tokens=8192), config=padded)])
    assert find(vocab=50263, hidden=768, tokens=8192)[0].pad_vocab is True  # odd to odd: the measured choice
    assert find(vocab=50304, hidden=768, tokens=8192)[0].pad_vocab is False  # aligned: nothing to pad


def test_export_layout(tmp_path):
    entries = [entry(), entry(device="h100"), entry(device="h100", tokens=4096)]
    paths = db.export_shipped(tmp_path / "out", entries)
    assert sorted(p.name for p in paths) == ["h100.json", "h200.json"]
    assert len(db.read_file(tmp_path / "out" / "h100.json", strict=True)) == 2
    with pytest.raises(ValueError, match="directory"):
        db.export_shipped(tmp_path / "one.json", entries)
    # one kind a file, also when the file already holds another kind
    with pytest.raises(ValueError, match=r"holds entries of GPU kind\(s\) \['h100'\]"):
        db.export_shipped(tmp_path / "out" / "h100.json", [entry()])
    assert {e.device for e in db.read_file(tmp_path / "out" / "h100.json", strict=True)} == {"h100"}
    db.export_shipped(tmp_path / "out" / "h100.json", [entry(device="h100", tokens=8192)])  # same kind: merged
    assert len(db.read_file(tmp_path / "out" / "h100.json", strict=True)) == 3
    # ".JSON" names a file too (it made a directory of that name, with h200.json in it)
    assert db.export_shipped(tmp_path / "H200.JSON", [entry()]) == [tmp_path / "H200.JSON"]
    assert (tmp_path / "H200.JSON").is_file()


def test_a_shipped_dir_that_is_not_there_is_said_once(dbs, monkeypatch, caplog):
    user, shipped = dbs
    monkeypatch.setenv(db.ENV_SHIPPED_DIR, str(shipped / "typo"))
    db.invalidate_cache()
    caplog.set_level(logging.WARNING, logger="flce_compile")
    for _ in range(3):
        assert find() is None  # nothing shipped to answer from; the heuristic decides
        db.invalidate_cache()
    warnings = [r.getMessage() for r in caplog.records if "is not a directory" in r.getMessage()]
    assert len(warnings) == 1 and db.ENV_SHIPPED_DIR in warnings[0]


def test_a_strategy_registered_or_unregistered_after_loading_is_seen_at_once(dbs):
    """Entries are checked against the registered strategies as the DB is read: one naming a plugin strategy
    registered after the load was dropped until the file changed, and one naming a strategy unregistered since
    stayed in the index and made the op's lookup raise. The registry's generation is part of the index's key."""
    from flce_compile.plan import registry

    user, _ = dbs
    toy = dataclasses.replace(registry.get("torch"), name="toy_tuned", summary="a plugin strategy")
    registry.register(toy)
    try:
        plugin = FLCEConfig(strategy="toy_tuned", chunk_tokens=512)
        db.write_entries(user, [dataclasses.replace(entry(), config=plugin)])
    finally:
        registry.unregister("toy_tuned")
    db.invalidate_cache()
    assert find() is None  # not registered: the entry is skipped (and reported), the heuristic answers
    registry.register(toy)
    try:
        config, source = find()
        assert (config.strategy, config.chunk_tokens, source) == ("toy_tuned", 512, "tuning_db:user_exact")
    finally:
        registry.unregister("toy_tuned")
    assert find() is None  # gone with its strategy, without an error
