"""The schedule simulator (titanlike.layout.timeline) against torch's schedules, its renderers and the script."""

import importlib.util
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from PIL import Image

from titanlike.config import parse_config
from titanlike.layout import SCHEDULES, bubble_formula, schedule_facts, schedule_timeline
from titanlike.layout.rules import rule_violations
from titanlike.models import get_spec
from titanlike.planner.schedule_plot import render_png, render_text

V_STYLE = ("ZBVZeroBubble", "DualPipeV")
CASES = [(name, 2 if name in V_STYLE or "Interleaved" in name or name == "LoopedBFS" else 1) for name in SCHEDULES]


def _check_timeline(tl):
    m, n_stages = tl.n_microbatches, tl.pp * tl.stages_per_rank
    where = {}  # (kind, stage, mb) -> block
    for rank, blocks in enumerate(tl.ranks):
        for prev, b in zip(blocks, blocks[1:]):
            assert prev.end <= b.start + 1e-9, f"rank {rank} runs two actions at once"
        for b in blocks:
            assert b.end > b.start >= 0
            assert tl.stage_to_rank[b.stage] == rank
            assert (b.kind, b.stage, b.microbatch) not in where
            where[(b.kind, b.stage, b.microbatch)] = b
    for s in range(n_stages):
        for i in range(m):
            assert ("F", s, i) in where
            full = ("B", s, i) in where
            split = ("I", s, i) in where and ("W", s, i) in where
            assert full != split, f"stage {s} mb {i}: need exactly one B or one I+W"
            bwd = where[("B", s, i)] if full else where[("I", s, i)]
            f = where[("F", s, i)]
            if s > 0:
                assert f.start >= where[("F", s - 1, i)].end
            assert bwd.start >= f.end
            if s < n_stages - 1:
                nxt = where.get(("B", s + 1, i)) or where[("I", s + 1, i)]
                assert bwd.start >= nxt.end
            if split:
                assert where[("W", s, i)].start >= where[("I", s, i)].end
    assert len(where) == sum(len(b) for b in tl.ranks)
    assert tl.makespan == max(b.end for blocks in tl.ranks for b in blocks)


@pytest.mark.parametrize("name,v", CASES)
def test_every_schedule_is_complete_and_respects_dependencies(name, v):
    for pp, m in [(4, 8), (2, 4)]:
        tl = schedule_timeline(name, pp, m, v)
        _check_timeline(tl)
        assert 0 <= tl.bubble_fraction < 1


@pytest.mark.parametrize("name,v", CASES)
def test_stage_placement(name, v):
    pp = 4
    tl = schedule_timeline(name, pp, 8, v)
    for r in range(pp):
        held = {s for s, rank in tl.stage_to_rank.items() if rank == r}
        expected = {r, 2 * pp - 1 - r} if name in V_STYLE else set(range(r, pp * v, pp))
        assert held == expected


@pytest.mark.parametrize("name", ["GPipe", "1F1B"])
@pytest.mark.parametrize("pp,m", [(4, 8), (4, 4), (2, 6), (8, 16)])
def test_single_stage_bubble_is_exact(name, pp, m):
    # Fill-drain with b = 2f: makespan (m + pp - 1)(f + b), each rank busy m(f + b).
    tl = schedule_timeline(name, pp, m, f_time=1.0, b_time=2.0)
    assert tl.makespan == pytest.approx((m + pp - 1) * 3.0)
    assert tl.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert tl.bubble_ratio == pytest.approx(bubble_formula(pp, m, 1))


def test_1f1b_steady_state_alternates():
    tl = schedule_timeline("1F1B", 4, 8)
    kinds = "".join(b.kind for b in tl.ranks[0])
    assert kinds == "FFFF" + "BF" * 4 + "BBBB"
    assert "".join(b.kind for b in tl.ranks[3]) == "FB" * 8


def _torch_has_single_stage_ir(name: str) -> bool:
    from torch.distributed.pipelining import schedules as S

    return S.get_schedule_class(name)._get_pipeline_order is not S.PipelineScheduleSingle._get_pipeline_order


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.skipif(not _torch_has_single_stage_ir(n), reason="this torch has no IR"))
        for n in ("GPipe", "1F1B")
    ],
)
def test_single_stage_order_matches_torch_ir(name):
    """Our replay of _step_microbatches equals torch's own schedule IR where torch has one.

    On the last rank torch 2.13's 1F1B IR numbers the forwards 1..m (it increments the
    forward counter before its first use when there is no warmup), while
    _step_microbatches runs 0..m-1; there we compare kinds and stages only."""
    from torch.distributed.pipelining import schedules as S

    cls = S.get_schedule_class(name)
    pp, m = 4, 8
    ir = cls._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    tl = schedule_timeline(name, pp, m)
    for rank in range(pp):
        want = [
            (a.computation_type.value, a.stage_index, a.microbatch_index)
            for a in ir[rank]
            if a is not None and a.computation_type.value in "FB"
        ]
        got = [(b.kind, b.stage, b.microbatch) for b in tl.ranks[rank]]
        if rank == pp - 1:
            got, want = [g[:2] for g in got], [w[:2] for w in want]
        assert got == want


def test_interleaving_shrinks_the_bubble():
    one = schedule_timeline("1F1B", 4, 8)
    inter = schedule_timeline("Interleaved1F1B", 4, 8, stages_per_rank=2)
    assert inter.bubble_fraction < one.bubble_fraction
    # torch's interleaved order meets the textbook (pp-1)/(v*m) exactly at f=1, b=2
    assert inter.bubble_ratio == pytest.approx(bubble_formula(4, 8, 2))
    for zb in ("InterleavedZeroBubble", "ZBVZeroBubble"):
        assert schedule_timeline(zb, 4, 8, 2).bubble_fraction < inter.bubble_fraction


def test_zero_bubble_split_durations():
    tl = schedule_timeline("ZBVZeroBubble", 2, 4, 2, f_time=1.0, b_time=3.0, w_time=1.0)
    durs = {(b.kind, b.duration) for blocks in tl.ranks for b in blocks}
    assert durs == {("F", 1.0), ("I", 2.0), ("W", 1.0)}


def test_dualpipev_overlapped_actions_run_back_to_back():
    tl = schedule_timeline("DualPipeV", 4, 8, 2)
    for blocks in tl.ranks:
        pairs = [
            (a, b)
            for a, b in zip(blocks, blocks[1:])
            if a.overlapped and b.overlapped and a.kind == "F" and b.kind == "B"
        ]
        assert pairs
        assert all(b.start >= a.end for a, b in pairs)
    assert sum(b.overlapped for blocks in tl.ranks for b in blocks) % 2 == 0


def test_invalid_arguments():
    with pytest.raises(ValueError, match="valid schedules: GPipe, 1F1B"):
        schedule_timeline("PipeDream", 4, 8)
    with pytest.raises(ValueError, match="stages_per_rank must be 2"):
        schedule_timeline("ZBVZeroBubble", 4, 8, 1)
    with pytest.raises(ValueError, match="stages_per_rank must be 1"):
        schedule_timeline("1F1B", 4, 8, 2)
    assert schedule_timeline("gpipe", 2, 2).schedule == "GPipe"


def test_render_text():
    tl = schedule_timeline("1F1B", 4, 8)
    text = render_text(tl)
    rows = [line for line in text.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4
    assert all(len(r) == len(rows[0]) for r in rows)
    # 33 time units of 2-char cells; rank 3 starts after 3 idle units with F0
    assert rows[3] == "rank 3 |" + ".." * 3 + "F0B0B0F1B1B1" + rows[3][26:]
    assert rows[0].endswith("B7B7|") and rows[3].endswith(".." * 6 + "|")
    assert "legend" in text
    lower = render_text(schedule_timeline("Interleaved1F1B", 2, 4, 2))
    assert "f0" in lower and "F0" in lower


def test_render_png(tmp_path):
    path = tmp_path / "s.png"
    tl = schedule_timeline("Interleaved1F1B", 4, 8, 2)
    render_png(tl, path)
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width > 400 and img.height > 4 * 30
        colors = {c for _, c in img.convert("RGB").getcolors(1 << 16)}
    assert (66, 133, 244) in colors  # forward blocks drawn in their colour
    render_png(schedule_timeline("DualPipeV", 4, 8, 2), tmp_path / "d.png")


def _load_script():
    path = Path(__file__).resolve().parents[2] / "scripts" / "plot_schedule.py"
    spec = importlib.util.spec_from_file_location("plot_schedule_script", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script(capsys, tmp_path):
    script = _load_script()
    png = tmp_path / "x.png"
    assert script.main(["--schedule", "1F1B", "--pp", "4", "--microbatches", "8", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert sum(line.startswith("rank ") for line in out.splitlines()) == 4
    assert "0.2727" in out and "0.3750" in out and png.exists()

    assert script.main(["--schedule", "Nope", "--pp", "4", "--microbatches", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and all(s in err[0] for s in SCHEDULES)


def test_counts_per_rank_are_balanced():
    tl = schedule_timeline("Interleaved1F1B", 4, 8, 2)
    for blocks in tl.ranks:
        assert Counter(b.kind for b in blocks) == {"F": 16, "B": 16}


def test_schedule_facts_are_read_off_torch():
    """The facts the rules and the simulator use instead of schedule names, as torch 2.13's classes give them; each
    agrees with the simulated action orders."""
    facts = {name: schedule_facts(name) for name in SCHEDULES}

    def having(attr):
        return {name for name, f in facts.items() if getattr(f, attr)}

    assert having("single_stage") == {"GPipe", "1F1B"}
    assert having("v_placement") == {"ZBVZeroBubble", "DualPipeV"}
    assert having("split_backward") == {"InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}
    assert having("breadth_first") == {"GPipe", "LoopedBFS"}
    assert having("microbatch_per_stage") == {"1F1B", "DualPipeV"}
    assert having("microbatch_rounds") == {"Interleaved1F1B", "InterleavedZeroBubble"}
    for name, v in CASES:
        tl = schedule_timeline(name, 2, 4, v)
        for blocks in tl.ranks:
            kinds = "".join(b.kind for b in blocks)
            assert (kinds.rstrip("BIW") == "F" * kinds.count("F")) == facts[name].breadth_first, (name, kinds)


@pytest.mark.parametrize(
    "schedule, local_batch, refused",
    [
        ("GPipe", 1, None),  # breadth-first: any number of microbatches
        ("LoopedBFS", 1, None),
        ("1F1B", 1, "are fewer than pp 2 stages for 1F1B"),
        ("ZBVZeroBubble", 1, "are fewer than pp 2 stages for ZBVZeroBubble"),
        ("DualPipeV", 2, "DualPipeV needs at least as many microbatches as stages (4), got 2"),
        ("DualPipeV", 4, None),
        ("Interleaved1F1B", 5, "Interleaved1F1B runs the 5 microbatches in rounds of pp=2"),
        ("InterleavedZeroBubble", 6, None),
    ],
)
def test_microbatch_rules_follow_the_facts(schedule, local_batch, refused):
    cfg = parse_config(
        [
            "--parallelism.pipeline_parallel_degree=2",
            f"--parallelism.pipeline_parallel_schedule={schedule}",
            f"--training.local_batch_size={local_batch}",
            "--model.n_layers=8",
        ]
    )
    args = get_spec("llama3").flavors["debugmodel"].replace(n_layers=8)
    got = [m for rule, m in rule_violations(cfg, 2, args) if rule == "pp_microbatches"]
    if refused is None:
        assert got == []
    else:
        assert len(got) == 1 and refused in got[0], got
