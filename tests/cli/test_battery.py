"""The battery script's roofline floor: the linear-layer counter counts what a forward multiplies
and reads."""

from __future__ import annotations

import pytest
import torch

from kvnotes.harness.roofline import machine_rates
from kvnotes.harness.roofline import Roofline
from tests.helpers import build_tiny

T = 11


def test_roofline_counts_every_linear_call():
    model = build_tiny("llama")
    cfg = model.config
    h, i, n, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // n)
    sizes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]      # q, k, v, o; gate, up, down
    per_layer = sum(o * k for o, k in sizes)
    L = cfg.num_hidden_layers
    roof = Roofline(model)
    ids = torch.arange(T)[None]
    with torch.no_grad():
        model(ids, logits_to_keep=1)                                       # one row unembedded
        before = roof.calls.copy()
        model(ids.expand(3, -1))                                           # 3 variants, every row unembedded
    flop_rate, byte_rate = 1e9, 1e8
    got = Roofline.floor(roof.calls, flop_rate, byte_rate)
    rows = (T, 3 * T)
    assert got["flops"] == sum(2 * r * L * per_layer for r in rows) + 2 * h * V * (1 + 3 * T)
    assert got["weight_bytes"] == 2 * 4 * (L * per_layer + h * V)          # fp32, each weight read per call
    floor = sum(max(2 * r * o * k / flop_rate, 4 * o * k / byte_rate) for r in rows for o, k in sizes) * L
    floor += max(2 * h * V / flop_rate, 4 * h * V / byte_rate) + max(2 * 3 * T * h * V / flop_rate, 4 * h * V / byte_rate)
    assert got["floor_s"] == pytest.approx(floor, rel=1e-9)
    second = Roofline.floor(roof.calls - before, flop_rate, byte_rate)     # the second forward alone
    assert second["flops"] == 2 * 3 * T * (L * per_layer + h * V)


def test_plain_forward_floors_one_forward_of_each_shape():
    """Each shape's floor is one forward's linear calls: a prefill of B x tokens rows, a decode of B
    rows (its cache prefill and the warm-up not counted), one unembedded row per prompt."""
    from kvnotes.harness.roofline import plain_forward

    model = build_tiny("llama")
    cfg = model.config
    h, i, n, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // n)
    per_layer = sum(o * k for o, k in [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)])
    roof = Roofline(model)
    rates = (1e9, 1e15)                                   # FLOP-bound: the floor is the FLOPs over 1e9
    rows = plain_forward(model, roof, rates, T, shapes=((2, "prefill"), (3, "decode")), repeats=2)
    assert [r["what"] for r in rows] == [f"prefill 2x{T}", "decode 3x1"]
    L = cfg.num_hidden_layers
    for r, tokens in zip(rows, (2 * T, 3)):
        prompts = r["rows"]
        assert r["floor_s"] == pytest.approx((2 * tokens * L * per_layer + 2 * prompts * h * V) / 1e9, rel=1e-9)
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["floor_s"]) and r["measured_s"] > 0


def test_plain_ratios_floor_one_decoder_forward_of_each_row_count():
    """Each timed forward is the decoder stack alone (no unembedding) feeding ``r`` rows on the
    context: its floor is ``2 r L per_layer`` FLOPs at a FLOP-bound rate, so measured / floor is
    the measured time over that; the grid spans the calls' rows in powers of two up to the cap."""
    from collections import Counter

    from kvnotes.harness.roofline import plain_ratios, row_grid

    model = build_tiny("gemma3")                          # sliding layers: the cache is put back after each forward
    cfg = model.config
    assert row_grid(Counter({(3, 1, 1, 4): 2, (40, 1, 1, 4): 1})) == [2, 4, 8, 16, 32, 64]
    assert row_grid(Counter({(1, 1, 1, 4): 1, (9000, 1, 1, 4): 1}), cap=16) == [1, 2, 4, 8, 16]
    roof = Roofline(model)
    ratios = plain_ratios(model, roof, (1e9, 1e15), T, [1, 4], repeats=2)
    assert sorted(ratios) == [1, 4] and all(x > 0 for x in ratios.values())
    rows = Counter(k[0] for k, n in roof.calls.items() for _ in range(n))
    assert set(rows) == {T, 1, 4}                         # the context's prefill, then 1 and 4 rows
    # one warm-up and two timed forwards per row count: 7 linear layers per decoder layer, no unembedding call
    assert sum(n for k, n in roof.calls.items() if k[0] in (1, 4)) == 3 * 2 * 7 * cfg.num_hidden_layers


def test_plain_equivalent_prices_each_call_at_its_row_count():
    """A call's floor times the ratio at its rows: exact at a timed row count, linear in log2(rows)
    between two, the nearest outside."""
    from collections import Counter

    from kvnotes.harness.roofline import plain_equivalent

    rates = (1e9, 1e15)                                   # FLOP-bound: a call's floor is 2 rows in out / 1e9
    ratios = {1: 2.0, 4: 4.0}

    def priced(rows: int) -> float:
        return plain_equivalent(Counter({(rows, 10, 10, 400): 1}), rates, ratios) / (2 * rows * 100 / 1e9)

    assert priced(1) == pytest.approx(2.0) and priced(4) == pytest.approx(4.0)
    assert priced(2) == pytest.approx(3.0)                # halfway in log2
    assert priced(64) == pytest.approx(4.0)
    both = Counter({(1, 10, 10, 400): 3, (2, 10, 10, 400): 1})
    assert plain_equivalent(both, rates, ratios) == pytest.approx(3 * 2.0 * 200 / 1e9 + 3.0 * 400 / 1e9)
    assert plain_equivalent(Counter(), rates, {}) == 0.0
    with pytest.raises(ValueError):
        plain_equivalent(both, rates, {})


def test_snapshot_puts_a_sliding_window_cache_back():
    from transformers import DynamicCache

    from kvnotes.harness.roofline import snapshot

    model = build_tiny("gemma3")
    ids = torch.arange(3 * T)[None] % model.config.vocab_size
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(ids[:, :2 * T], past_key_values=cache, use_cache=True)
        before = [(l.keys.clone(), l.values.clone(), getattr(l, "cumulative_length", None)) for l in cache.layers]
        restore = snapshot(cache)
        model(ids[:, 2 * T:], past_key_values=cache, use_cache=True)
        restore()
        after = [(l.keys, l.values, getattr(l, "cumulative_length", None)) for l in cache.layers]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] for a, b in zip(before, after))
        again = model(ids[:, 2 * T:], past_key_values=cache, use_cache=True).logits
        fresh = model(ids).logits[:, 2 * T:]
        torch.testing.assert_close(again, fresh, atol=1e-4, rtol=1e-4)


def test_machine_rates_are_positive():
    flop_rate, byte_rate = machine_rates(build_tiny("llama"), rows=64, repeats=2)
    assert flop_rate > 1e6 and byte_rate > 1e6


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_forward_floor_counts_what_a_forward_reads(arch):
    """The analytic floor's weight bytes are the bytes the model's linear layers really hold (GQA
    included), its KV bytes the cache's, and it takes the larger of the two times."""
    from kvnotes.harness.roofline import forward_floor_s, kv_bytes
    from kvnotes.ops.edit import forward_flops, params_per_token

    model = build_tiny(arch)
    cfg = model.config
    roof = Roofline(model)
    with torch.no_grad():
        out = model(torch.arange(T)[None], logits_to_keep=1, use_cache=True)
    counted = Roofline.floor(roof.calls, 1.0, 1.0)["weight_bytes"]
    head = cfg.vocab_size * cfg.hidden_size
    assert counted == 4 * (params_per_token(cfg) + head)                   # fp32 linear weights, one call each
    cache = out.past_key_values
    held = sum(l.keys.numel() * 4 + l.values.numel() * 4 for l in cache.layers)
    assert kv_bytes(cfg, T, 4) == held
    slow_flops, slow_bytes = (1e3, 1e15), (1e15, 1e3)
    assert forward_floor_s(cfg, slow_flops, 4, 5, 40, T) == pytest.approx(forward_flops(cfg, 5, 40) / 1e3)
    moved = 4 * (params_per_token(cfg) + head) + kv_bytes(cfg, T, 4) + 7
    assert forward_floor_s(cfg, slow_bytes, 4, 5, 40, T, logit_rows=1, extra_bytes=7) == pytest.approx(moved / 1e3)


@pytest.mark.embedded
def test_battery_writes_the_records_run_py_writes(tmp_path, monkeypatch, capsys):
    """``kvnotes battery --records DIR`` runs each probe through ``run.py``'s job path: ``run.py`` then
    finds the record complete (the same config and inputs) and skips the job, and a record ``run.py``
    writes elsewhere holds the same result (timing aside), config and prompts. The suite is a user's
    own scenario config (``--config-dir``, for both commands): one scenario, one instance."""
    import json

    from kvnotes.records.diff import result_diff
    from tests.helpers import run_kvnotes
    from tests.cli.test_cli import run_main

    battery, alone, conf = tmp_path / "battery", tmp_path / "alone", tmp_path / "conf"
    (conf / "scenario").mkdir(parents=True)
    (conf / "scenario" / "one.yaml").write_text("defaults:\n  - default\n  - _self_\nname: one\nids: [home_city]\n"
                                                "n_instances: 1\n")
    monkeypatch.chdir(tmp_path)
    ran = run_kvnotes(monkeypatch, capsys, "battery", "--config-dir", conf, "--probes", "screen", "--scenario", "one",
                      "--records", battery)
    assert ran.returncode == 0, ran.stderr
    assert "screen" in ran.stdout
    path = battery / "smollm2-135m" / "screen" / "one" / "record.json"
    user = ["--config-dir", str(conf), "probe=screen", "scenario=one"]
    proc = run_main(monkeypatch, capsys, *user, f"out_root={battery}")
    assert proc.returncode == 0 and f"{path} is complete; skipping" in proc.stdout, proc.stdout + proc.stderr
    proc = run_main(monkeypatch, capsys, *user, f"out_root={alone}", "plot=false")
    assert proc.returncode == 0, proc.stderr
    a, b = (json.loads(p.read_text()) for p in (path, alone / path.relative_to(battery)))
    diff = result_diff(a, b)
    assert diff.n_numbers > 20 and not diff.mismatches, diff.summary()
    assert a["scenario"]["n_scenarios"] == 1 and a["result"]["rows"]
    for key in ("scenario", "prompts", "vocab", "inputs", "model"):
        assert a[key] == b[key], key
    from kvnotes.harness.runconfig import identity, identity_diff

    assert not identity_diff(identity(a["config"]), identity(b["config"]))    # what run.py compares before reusing
    assert a["hydra"]["choices"] == b["hydra"]["choices"]


def test_battery_lengths_times_each_probe_per_length_and_fits_the_growth(tmp_path, monkeypatch, capsys):
    """``--lengths``: one battery per prompt length, the suite rendered as transcripts with as many
    turns as reach each length (the shorter gets fewer); each probe's time and peak memory per
    length and the fitted exponent of time against the median prompt length; with ``--floor`` its
    time over the plain forward of the same calls and over the floor per length."""
    import json

    from tests.helpers import run_kvnotes

    out = tmp_path / "lengths.json"
    ran = run_kvnotes(monkeypatch, capsys, "battery", "--model", "planted-notes", "--scenario", "planted",
                      "--lengths", "200,800", "--floor", "--probes", "field_refresh", "--json", out,
                      "flip_rule=relative")
    assert ran.returncode == 0, ran.stderr
    runs = json.loads(out.read_text())
    short, long = runs["lengths"]["200"], runs["lengths"]["800"]
    assert short["overrides"] != long["overrides"] and short["median_tokens"] < long["median_tokens"]
    assert short["overrides"][0] == "flip_rule=relative" and short["pairs_measured"]["field_refresh"] > 0
    assert abs(long["median_tokens"] - 800) < 0.25 * 800
    assert set(short["probe_s"]) == {"field_refresh"} and short["peak_mb"]["field_refresh"] >= 0
    assert isinstance(runs["exponents"]["field_refresh"], float) and "exponent" in ran.stdout
    for run in (short, long):           # --floor: the probe held to the plain forward of its own linear calls
        roof = run["roofline"]
        over, floor = roof["overhead"]["field_refresh"], roof["probes"]["field_refresh"]["floor_s"]
        assert roof["plain_ratios"] and all(x > 0 for x in roof["plain_ratios"].values())
        assert over["plain_s"] > floor > 0 and over["ratio"] == run["probe_s"]["field_refresh"] / over["plain_s"]
    assert "the plain forward of the same calls (target 1.2x)" in ran.stdout
    for bad, says in ((["--lengths", "8"], "--lengths: comma-separated token counts of at least 16"),
                      (["--lengths", "100", "--records", str(tmp_path / "r"), "--compare", str(tmp_path)],
                       "run it without --lengths")):
        ran = run_kvnotes(monkeypatch, capsys, "battery", "--model", "planted-notes", *bad)
        assert ran.returncode == 2 and says in ran.stderr and "Traceback" not in ran.stderr, ran.stderr


@pytest.mark.embedded
def test_battery_on_a_random_weight_shape_with_per_probe_overrides(tmp_path, monkeypatch, capsys):
    """What ``scripts/gpu_battery.sh`` runs, on the CPU-sized shape: a random-weight zoo entry whose
    prompts are rendered by a tokenizer directory (``model.random_init.tokenizer``, a node without
    the embedded package), ``--lengths`` (the turns are counted with that tokenizer), and
    ``PROBE:KEY=VALUE`` overrides that reach one probe's config only; a prefix naming no probe is one line."""
    import json

    from kvnotes.models.loading import random_init_tokenizer
    from tests.helpers import run_kvnotes

    tok = tmp_path / "tok"
    random_init_tokenizer("smollm2-135m").save_pretrained(tok)
    common = ["--model", "qwen3-8b", "--scenario", "small", "--device", "cpu",
              "model.random_init.enabled=true", f"model.random_init.tokenizer={tok}", "flip_rule=synthetic",
              "min_effect=0.005", "scenario.families=null", "scenario.ids=[favourite_colour]", "scenario.n_instances=2"]
    out, records = tmp_path / "run.json", tmp_path / "records"
    heads_keys = ["probe.ks=[1,4]", "probe.random.n_draws=1", "probe.max_map_pairs_per_family=1"]
    ran = run_kvnotes(monkeypatch, capsys, "battery", *common, *(f"heads:{k}" for k in heads_keys),
                      "--lengths", "200,320", "--records", records, "--json", out, "--probes", "screen", "heads")
    assert ran.returncode == 0, ran.stderr
    runs = json.loads(out.read_text())["lengths"]
    assert [r["median_tokens"] for r in runs.values()] == sorted(r["median_tokens"] for r in runs.values())
    assert all(r["probe_overrides"] == {"heads": heads_keys} for r in runs.values())
    heads = [json.loads(p.read_text()) for p in records.rglob("record.json") if "/heads/" in str(p)]
    assert heads and all(h["config"]["probe"]["ks"] == [1, 4] and h["model"]["source"] == "random" for h in heads)
    assert all(h["inputs"]["weights"]["tokenizer"]["path"] == str(tok.resolve()) for h in heads)
    ran = run_kvnotes(monkeypatch, capsys, "battery", *common, "nosuch:probe.ks=[1]", "--probes", "screen")
    assert ran.returncode == 2 and "'nosuch' is not a probe" in ran.stderr and "Traceback" not in ran.stderr
