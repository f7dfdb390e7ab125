"""``flce-tune --retune-ce-tiles``: which tiles are timed, how a tile is picked, how an entry is rewritten (the
CE-step timer and the whole call are faked on CPU), the CLI flow with a fake GPU, and the real timer on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flce_compile.plan.config import FLCEConfig
from flce_compile.plan.registry import MAX_ELEMENTS_PER_THREAD
from flce_compile.tuning import ce_tiles, db

from test_tuning_cli import _fake_gpu, _private_env, make_entry  # noqa: F401 - _private_env: autouse fixture


Tile = ce_tiles.Tile


def test_legal_tiles_follow_the_launch_rules():
    tiles = ce_tiles.legal_tiles(128256)
    assert Tile(4096, 8, 1) in tiles and Tile(16384, 32, 3) in tiles
    for block_v, num_warps, _, _ in tiles:
        threads = 32 * num_warps
        assert threads <= block_v and block_v // threads <= MAX_ELEMENTS_PER_THREAD
    # every tile both ways: pass 1 block-wise and lane-wise
    assert {t for t in tiles if t.lane_pass} == {t._replace(lane_pass=True) for t in tiles if not t.lane_pass}
    assert len(tiles) == 2 * len({t[:3] for t in tiles})
    # a small vocabulary rules out blocks above its next power of two
    assert max(t.block_v for t in ce_tiles.legal_tiles(1000)) == 1024


def test_tile_names_read_back_and_set_the_config():
    for tile in (Tile(4096, 8, 1), Tile(8192, 32, 2, True)):
        assert ce_tiles.parse_tile(ce_tiles.tile_name(tile)) == tile
        assert ce_tiles.tile_of(ce_tiles.with_tile(FLCEConfig(strategy="triton"), tile)) == tile
    # block-wise names are the records' names from before lane-wise tiles
    assert ce_tiles.tile_name((4096, 8, 1)) == "4096:8:1"
    assert ce_tiles.tile_name(Tile(4096, 8, 1, True)) == "4096:8:1:lanes"
    assert ce_tiles.with_tile(FLCEConfig(lane_pass=True), Tile(1024, 4, 1)).lane_pass is False


def _timer(times: dict[Tile, float], calls: list | None = None):
    def timer(rows, vocab, dtype, tile):
        if calls is not None:
            calls.append((rows, vocab, tile))
        if tile not in times:
            raise RuntimeError("out of resource: shared memory")
        return times[tile]
    return timer


def test_pick_tile_takes_the_fastest_and_memoises():
    times = {t: 2.0 for t in ce_tiles.legal_tiles(128256)}
    times[Tile(4096, 8, 1)] = 1.0
    del times[Tile(16384, 32, 3)]  # fails to launch: recorded, not fatal
    calls: list = []
    memo: dict = {}
    pick = ce_tiles.pick_tile(_timer(times, calls), 4096, 128256, torch.bfloat16, (4096, 16, 1), memo)
    assert pick.chosen == Tile(4096, 8, 1) and pick.changed
    assert "16384:32:3" in pick.failed and "16384:32:3" not in pick.ms and "16384:32:3:lanes" in pick.ms
    assert pick.record()["from"] == "4096:16:1" and pick.record()["to"] == "4096:8:1"
    n = len(calls)
    again = ce_tiles.pick_tile(_timer(times, calls), 4096, 128256, torch.bfloat16, (8192, 16, 1), memo)
    assert len(calls) == n and again.chosen == Tile(4096, 8, 1)  # same chunk: no new timing


def test_pick_tile_keeps_the_current_tile_within_the_noise():
    times = {t: 2.0 for t in ce_tiles.legal_tiles(50304)}
    times[Tile(4096, 16, 1)] = 1.000
    times[Tile(2048, 4, 1)] = 0.990  # 1% faster: below MIN_GAIN
    pick = ce_tiles.pick_tile(_timer(times), 4096, 50304, torch.bfloat16, (4096, 16, 1))
    assert pick.chosen == Tile(4096, 16, 1) and not pick.changed
    times[Tile(2048, 4, 1)] = 0.97
    assert ce_tiles.pick_tile(_timer(times), 4096, 50304, torch.bfloat16, (4096, 16, 1)).chosen == Tile(2048, 4, 1)


def test_pick_tile_takes_a_lane_wise_tile_where_it_is_faster():
    """GPT-2's chunk on an H100 (2026-12-07): pass 1 lane-wise at 8192:32 ran the CE step 9% faster than the
    block-wise pass's best tile. The pick moves the entry to it, and back where block-wise wins."""
    times = {t: 2.0 for t in ce_tiles.legal_tiles(50257)}
    times[Tile(4096, 8, 1)] = 0.394
    times[Tile(8192, 32, 1, True)] = 0.358
    pick = ce_tiles.pick_tile(_timer(times), 4096, 50257, torch.bfloat16, (4096, 8, 1))
    assert pick.chosen == Tile(8192, 32, 1, True) and pick.record()["to"] == "8192:32:1:lanes"
    entry = make_entry(config=FLCEConfig(strategy="triton", chunk_tokens=4096, block_v=4096, num_warps=8))
    result = ce_tiles.retune_entry(entry, _timer(times), lambda e, c: (1.0, 1), entry.config)
    assert result.new.config.lane_pass and result.new.config.block_v == 8192
    times[Tile(8192, 32, 1, True)] = 0.5
    back = ce_tiles.pick_tile(_timer(times), 4096, 50257, torch.bfloat16, Tile(8192, 32, 1, True))
    assert back.chosen == Tile(4096, 8, 1)


def _fast_tile_timer():
    times = {t: 2.0 for t in ce_tiles.legal_tiles(256000)}
    times[Tile(4096, 8, 1)] = 1.0
    return _timer(times)


def test_retune_entry_rewrites_config_and_both_timings():
    entry = make_entry(config=FLCEConfig(strategy="triton", chunk_tokens=2048, block_v=8192, num_warps=16),
                       extra={"measured_tokens": 8192, "device_name": "NVIDIA H200"})
    default = FLCEConfig(strategy="triton", chunk_tokens=1024, block_v=4096, num_warps=8)
    seen = []

    def whole_call(e, config):
        seen.append(config)
        return (10.0, 2_000_000_000) if config.chunk_tokens == 2048 else (12.0, 1_000_000_000)

    result = ce_tiles.retune_entry(entry, _fast_tile_timer(), whole_call, default,
                                   stamp={"torch": "t", "triton": "tr", "date": "d"})
    new = result.new
    assert new.config == dataclasses.replace(entry.config, block_v=4096, num_warps=8, num_stages=1)
    assert seen == [new.config, default]
    assert (new.ms, new.peak_gb, new.default_ms, new.default_peak_gb) == (10.0, 2.0, 12.0, 1.0)
    assert (new.torch, new.triton, new.date) == ("t", "tr", "d")
    assert new.extra["ce_tile_retune"]["from"] == "8192:16:1" and new.extra["device_name"] == "NVIDIA H200"
    assert new.extra["default_config"] == default.to_dict() and new.key == entry.key
    assert result.pick.rows == 2048  # the CE step runs on chunk_tokens rows


def test_retune_entry_takes_a_faster_default_and_skips_what_it_cannot_pick():
    entry = make_entry(config=FLCEConfig(strategy="triton", chunk_tokens=2048, block_v=8192, num_warps=16))
    default = FLCEConfig(strategy="triton", chunk_tokens=1024, block_v=4096, num_warps=8)
    result = ce_tiles.retune_entry(entry, _fast_tile_timer(),
                                   lambda e, c: (10.0, 1) if c == default else (11.0, 1), default)
    assert result.took_default and result.new.config == default and result.new.ms == result.new.default_ms == 10.0
    # the default measured once when it is the entry's own config
    calls = []
    same = make_entry(config=default)
    ce_tiles.retune_entry(same, _fast_tile_timer(), lambda e, c: calls.append(c) or (5.0, 1), default)
    assert calls == [default]
    recompute = make_entry(config=FLCEConfig(strategy="recompute", chunk_tokens=2048), budget_tier_gb=0.5)
    assert "strategy recompute" in ce_tiles.retune_entry(recompute, None, None, default).skipped
    tier = make_entry(budget_tier_gb=0.5)
    assert "budget tier" in ce_tiles.retune_entry(tier, None, None, default).skipped


def test_cli_retunes_a_file_with_a_fake_gpu(tmp_path, monkeypatch, capsys):
    """The mode end to end on CPU: every plain triton entry is rewritten as it is done, the others are listed as
    kept, --skip-existing resumes, and the measured problem is the entry's own."""
    from flce_compile.tuning import cli, measure

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(ce_tiles, "ce_step_timer", lambda device, **kw: _fast_tile_timer())
    problems = []

    def fake_make_objective(problem, **kw):
        problems.append((problem.tokens, problem.vocab, problem.hidden, problem.device.index))
        return lambda config: (3.0 if config.num_warps == 8 else 4.0, 1_000_000)

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    path = tmp_path / "h200.json"
    plain = make_entry(config=FLCEConfig(strategy="triton", chunk_tokens=2048, block_v=8192, num_warps=16),
                       extra={"measured_tokens": 6000})
    tier = make_entry(config=FLCEConfig(strategy="recompute", chunk_tokens=2048), budget_tier_gb=0.5)
    other_gpu = make_entry(device="a100")
    db.write_entries(path, [plain, tier, other_gpu])
    code = cli.main(["--retune-ce-tiles", "--out", str(path)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert problems == [(6000, 256000, 2304, 0)]  # inputs and reference once per entry
    by_key = {e.key: e for e in db.read_file(path, strict=True)}
    assert by_key[plain.key].config.num_warps == 8 and by_key[plain.key].ms == 3.0
    assert by_key[tier.key] == tier and by_key[other_gpu.key] == other_gpu
    assert "1 entries rewritten" in captured.out and "kept: strategy recompute" in captured.out
    code = cli.main(["--retune-ce-tiles", "--out", str(path), "--skip-existing"])
    assert code == 0 and "skipped (done)" in capsys.readouterr().out


def test_skip_existing_repicks_tiles_picked_for_another_kernel_revision():
    """--skip-existing skips an entry only when its tile was picked by this torch, triton and CE kernel revision:
    a pick without a revision (made before revisions were recorded) or of an older one is redone."""
    from flce_compile.kernels import CE_CHUNK_REVISION
    from flce_compile.tuning.cli_retune import _already_retuned

    versions = db.versions()
    here = {"torch": versions["torch"], "triton": versions["triton"]}
    record = {"rows": 2048, "from": "8192:16:1", "to": "4096:8:1"}
    current = make_entry(extra={"ce_tile_retune": {**record, "kernel_revision": CE_CHUNK_REVISION}}, **here)
    unrevised = make_entry(extra={"ce_tile_retune": record}, **here)
    older = make_entry(extra={"ce_tile_retune": {**record, "kernel_revision": CE_CHUNK_REVISION - 1}}, **here)
    other_torch = dataclasses.replace(current, torch="0.0")
    never = make_entry(**here)
    assert _already_retuned(current, versions)
    assert not any(_already_retuned(e, versions) for e in (unrevised, older, other_torch, never))
    assert CE_CHUNK_REVISION >= 2  # the picks of 2026-12-01's kernel change must not count as done
    picked = ce_tiles.pick_tile(_fast_tile_timer(), 64, 4096, torch.float32, (8192, 16, 1))
    assert picked.record()["kernel_revision"] == CE_CHUNK_REVISION


def test_cli_retune_interrupted_keeps_what_it_wrote(tmp_path, monkeypatch, capsys):
    from flce_compile.tuning import cli, measure

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(ce_tiles, "ce_step_timer", lambda device, **kw: _fast_tile_timer())
    calls = []

    def fake_make_objective(problem, **kw):
        calls.append(problem.tokens)
        if len(calls) == 2:
            raise KeyboardInterrupt("signal 15")
        return lambda config: (3.0, 1_000_000)

    monkeypatch.setattr(measure, "make_objective", fake_make_objective)
    path = tmp_path / "h200.json"
    first, second = make_entry(tokens=4096), make_entry(tokens=8192)
    db.write_entries(path, [first, second])
    assert cli.main(["--retune-ce-tiles", "--out", str(path)]) == 130
    captured = capsys.readouterr()
    assert "interrupted during V=256000 H=2304 T=8192" in captured.err and "interrupted" in captured.out
    by_key = {e.key: e for e in db.read_file(path, strict=True)}
    assert "ce_tile_retune" in by_key[first.key].extra and by_key[second.key] == second


def test_cli_retune_errors(tmp_path, monkeypatch, capsys):
    from flce_compile.tuning import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--retune-ce-tiles", "--out", str(tmp_path / "x.json")]) == 2
    assert "there is none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--retune-ce-tiles", "--list"])
    assert "separate modes" in capsys.readouterr().err
    _fake_gpu(monkeypatch)
    assert cli.main(["--retune-ce-tiles", "--out", str(tmp_path / "empty.json")]) == 1
    assert "has no h200 entries" in capsys.readouterr().err
    assert cli.main(["--retune-ce-tiles", "--out", str(tmp_path / "x.json"), "--device", "cpu"]) == 2
    assert "not a CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--retune-ce-tiles", "--reps", "3"])
    assert "--reps must be >= 10" in capsys.readouterr().err


def test_the_timer_runs_the_kernel_on_padded_rows(monkeypatch):
    """The real timer through Triton's interpreter (conftest sets TRITON_INTERPRET=1) at a tiny odd V: the step
    sees V columns at the chunk loop's padded row stride, refilled before each run, and the loss it writes is
    right."""
    import os

    from flce_compile.strategies import ce_triton

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    seen = []
    real = ce_triton.ce_step_triton

    def spy(args, p, config):
        seen.append((args.logits.shape, args.logits.stride(), args.logits.clone(), config.num_warps))
        real(args, p, config)
        spy.args, spy.config = args, config

    monkeypatch.setattr(ce_triton, "ce_step_triton", spy)
    timer = ce_tiles.ce_step_timer(torch.device("cpu"), reps=2, warmup=1)
    ms = timer(3, 301, torch.bfloat16, (128, 4, 1))
    assert ms > 0 and len(seen) == 3 and seen[0][3] == 4
    assert {s[:2] for s in seen} == {((3, 301), (320, 1))}  # 301 bf16 columns padded to 640 bytes
    assert all(torch.equal(s[2], seen[0][2]) for s in seen)  # every run starts from the same refilled logits
    # the loss rows of the last run: the fp32 cross-entropy of those logits, times ce_scale = 1/rows
    expected = torch.nn.functional.cross_entropy(seen[0][2].float(), spy.args.target, reduction="none") / 3
    torch.testing.assert_close(spy.args.loss_out, expected, rtol=1e-5, atol=1e-6)
    timer(3, 301, torch.bfloat16, (256, 4, 1))  # another tile on the same chunk: the same inputs
    assert torch.equal(seen[-1][2], seen[0][2])
    block_wise = spy.args.loss_out.clone()
    timer(3, 301, torch.bfloat16, Tile(128, 4, 1, True))  # pass 1 lane-wise: the config says so, same loss
    assert spy.config.lane_pass and ce_triton.lanes(128, 4, spy.config.lane_pass) > 0
    torch.testing.assert_close(spy.args.loss_out, block_wise, rtol=1e-6, atol=0)
    chunk = timer.chunk(3, 301, torch.bfloat16)  # what the benchmark checks losses on: the timed inputs
    assert chunk.args is spy.args and torch.equal(chunk.source, seen[0][2]) and chunk.logits.stride() == (320, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ce_step_timer_times_real_tiles():
    timer = ce_tiles.ce_step_timer(torch.device("cuda", torch.cuda.current_device()), reps=3)
    pick = ce_tiles.pick_tile(timer, 256, 50304, torch.bfloat16, (4096, 16, 1))
    assert pick.ms and all(ms > 0 for ms in pick.ms.values())
    assert ce_tiles.tile_name(pick.chosen) in pick.ms
