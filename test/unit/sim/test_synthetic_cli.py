from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sgl_importance.sim.__main__ import main
from sgl_importance.sim.replay import prepare_hot, replay_hot
from sgl_importance.sim.synthetic import KINDS, NODE_SHIFT, synthesize


@pytest.mark.parametrize("kind", KINDS)
def test_synthetic_trace_is_a_valid_trace_whose_masses_sum_to_one_per_step(kind):
    ts = synthesize(kind, seed=3, scale=0.3)
    tr = ts.accesses
    grp = np.unique(np.stack([tr.step, tr.request_id, tr.layer, tr.kv_head]), axis=1, return_inverse=True)[1]
    sums = np.bincount(grp.reshape(-1), weights=tr.importance.astype(np.float64))
    assert np.allclose(sums, 1.0, atol=1e-4)
    assert np.array_equal(tr.node_id, tr.page >> NODE_SHIFT)
    # every page belongs to the request's prompt path or to its output node
    for i in range(len(ts.requests)):
        rid = ts.requests.request_id[i]
        nodes = set(ts.requests.path(i)[0].tolist())
        seen = set(np.unique(tr.node_id[tr.request_id == rid]).tolist())
        assert len(seen - nodes) == 1


def test_synthetic_traces_are_reproducible_from_the_seed():
    a = synthesize("rag", seed=7, scale=0.2)
    b = synthesize("rag", seed=7, scale=0.2)
    c = synthesize("rag", seed=8, scale=0.2)
    assert np.array_equal(a.accesses.importance, b.accesses.importance)
    assert np.array_equal(a.accesses.page, b.accesses.page)
    assert not (len(a.accesses) == len(c.accesses) and np.array_equal(a.accesses.importance, c.accesses.importance))


def test_synthetic_heads_differ_when_layers_and_heads_are_requested():
    ts = synthesize("agent", seed=0, scale=0.34, layers=2, kv_heads=2)
    tr = ts.accesses
    assert set(zip(tr.layer.tolist(), tr.kv_head.tolist())) == {(0, 0), (0, 1), (1, 0), (1, 1)}
    a = tr.importance[(tr.layer == 0) & (tr.kv_head == 0)]
    b = tr.importance[(tr.layer == 1) & (tr.kv_head == 1)]
    assert a.shape == b.shape and not np.allclose(a, b)


def test_loop_workload_starves_lru_while_decayed_mass_keeps_the_heavy_pages():
    hs = prepare_hot(synthesize("loop", seed=0).accesses, "mass:0.9")
    res = {r.policy: r for r in replay_hot(hs, ["lru", "decayed_mass", "belady"], [0.1])}
    assert res["lru"].hit_rate < 0.05
    assert res["decayed_mass"].hit_rate > 0.2
    assert res["belady"].hit_rate >= res["decayed_mass"].hit_rate


def test_chain_of_thought_workload_rewards_decayed_mass_over_recency_in_mass_recall():
    hs = prepare_hot(synthesize("cot", seed=0).accesses, "mass:0.9")
    res = {r.policy: r for r in replay_hot(hs, ["lru", "decayed_mass"], [0.1])}
    assert res["decayed_mass"].mass_recall > res["lru"].mass_recall


def test_cli_synth_replay_analyze_writes_reports(tmp_path: Path):
    trace = tmp_path / "rag"
    assert main(["synth", "--kind", "rag", "--scale", "0.2", "--out", str(trace)]) == 0
    rep = tmp_path / "rep"
    assert (
        main(
            [
                "replay",
                "--trace",
                str(trace),
                "--out",
                str(rep),
                "--policies",
                "lru,decayed_mass:decay=0.9,belady",
                "--budgets",
                "0.1,0.5",
                "--quiet",
            ]
        )
        == 0
    )
    for f in ("report.md", "results.json", "hot_hit_rate.png", "hot_mass_recall.png", "prefix_hit_rate.png"):
        assert (rep / f).stat().st_size > 0, f
    res = json.loads((rep / "results.json").read_text())
    assert {(r["regime"], r["policy"], r["budget_frac"]) for r in res} == {
        (g, p, b) for g in ("hot", "prefix") for p in ("lru", "decayed_mass:decay=0.9", "belady") for b in (0.1, 0.5)
    }
    md = (rep / "report.md").read_text()
    assert "| decayed_mass:decay=0.9 |" in md and "hit / Belady" in md
    an = tmp_path / "an"
    assert main(["analyze", "--trace", str(trace), "--out", str(an), "--k", "8"]) == 0
    for f in ("analysis.md", "analysis.json", "reuse_cdf.png", "segments.png"):
        assert (an / f).stat().st_size > 0, f


def test_cli_rejects_an_unknown_policy_with_its_name(tmp_path: Path):
    with pytest.raises(SystemExit, match="nosuch"):
        main(["replay", "--trace", str(tmp_path), "--out", str(tmp_path / "o"), "--policies", "lru,nosuch"])


def test_simulator_imports_neither_torch_nor_sglang():
    code = (
        "import sys, sgl_importance.sim.__main__, sgl_importance.sim.analyses, sgl_importance.sim.report, "
        "sgl_importance.sim.prefix, sgl_importance.sim.synthetic; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    src = Path(__file__).resolve().parents[3] / "python"
    r = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(src)}, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
