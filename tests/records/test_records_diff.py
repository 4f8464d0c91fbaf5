"""kvnotes.records.diff: a result compared with itself, with float noise, and with real changes."""

from kvnotes.records.diff import RECORD_ATOL, result_diff


def test_result_diff_tolerates_noise_and_lists_changes():
    ref = {"result": {"rows": [{"kl": 0.5, "s_old": 1.0, "top1": 7, "owned": True, "agent_ms": 12.0}],
                      "aggregates": {"mean": 1.25, "time": {"ratio": 2.0}, "oracle_ms_total": 5.0, "time_ratio": 1.0}}}
    assert result_diff(ref, ref).mismatches == [] and result_diff(ref, ref).n_numbers == 3
    noisy = {"result": {"rows": [{"kl": 0.5 + RECORD_ATOL / 2, "s_old": 1.0, "top1": 7, "owned": True, "agent_ms": 99.0}],
                        "aggregates": {"mean": 1.25, "time": {"ratio": 3.0}, "oracle_ms_total": 9.0, "time_ratio": 2.0}}}
    d = result_diff(noisy, ref)
    assert d.mismatches == [] and abs(d.max_abs - RECORD_ATOL / 2) < 1e-12 and d.max_path == "result.rows[0].kl"
    changed = {"result": {"rows": [{"kl": 0.6, "s_old": 2.0, "top1": 8, "owned": False, "agent_ms": 1.0}, {}], "aggregates": {}}}
    got = result_diff(changed, ref).mismatches
    assert "result.rows: length 2 != 1" in got
    assert any(m.startswith("result.rows[0].kl: 0.6") for m in got)
    assert any(m.startswith("result.rows[0].s_old: 2") for m in got)             # a score, not a time
    assert "result.rows[0].top1: 8 != 7" in got and "result.rows[0].owned: False != True" in got
    assert any(m.startswith("result.aggregates: keys") for m in got)
    assert not any("agent_ms" in m for m in got)                       # wall times are not compared


def test_the_memory_probes_wall_times_are_not_compared():
    """The memory probes' wall times (time to first token, cumulative time, a mean of seconds) are
    skipped like every other wall time; a cumulative length is not a time."""
    ref = {"result": {"rows": [{"ttft": 1.0, "cum": 2.0, "ttft_full": 1.0, "cum_full": 2.0, "cumulative_length": 5.0}],
                      "aggregates": {"full_s_mean": 1.4, "cum_ttft_ratio": 1.3, "cum_ttft_full_s": 2.0}}}
    slower = {"result": {"rows": [{"ttft": 9.0, "cum": 9.0, "ttft_full": 9.0, "cum_full": 9.0, "cumulative_length": 6.0}],
                         "aggregates": {"full_s_mean": 0.7, "cum_ttft_ratio": 1.9, "cum_ttft_full_s": 9.0}}}
    assert result_diff(slower, ref).mismatches == ["result.rows[0].cumulative_length: 6 != 5"]

