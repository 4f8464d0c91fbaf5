"""The HTML report, built from records of a real embedded-model run (the command-line sweep), loaded
page by page in a real headless Chromium: no console errors, the expected figures present, a token
strip as long as the pair's prompt, a hover value equal to the record's number. The site holds one
plotly.js that every page loads by a relative path; the per-family figures and the curves over k
are checked on records written here (no model)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from kvnotes.records.store import load_record

#: CI installs Chromium and its driver from the Debian packages (.ci/run); elsewhere the browser
#: test runs where they are installed (apt-get install chromium chromium-driver).
BROWSER = shutil.which("chromedriver") and (shutil.which("chromium") or shutil.which("chromium-browser"))


def test_report_without_records_is_one_line(tmp_path, capsys):
    from kvnotes.records.report import main

    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path), "-o", str(tmp_path / "site")])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith("kvnotes: error: no complete record")


@pytest.fixture(scope="module")
def site(sweep, tmp_path_factory):
    from kvnotes.records.report import build_report

    out = tmp_path_factory.mktemp("site")
    return out, build_report([sweep[0]], out)


def test_report_pages_and_raw_json(site):
    out, manifest = site
    assert (out / "index.html").is_file()
    assert sorted(p["probe"] for p in manifest["pages"]) == ["blast_radius", "screen"]
    for p in manifest["pages"]:
        page = (out / p["page"]).read_text()
        raw = out / "records" / p["page"].replace(".html", ".json")
        assert json.loads(raw.read_text())["probe"] == p["probe"]
        assert "<mark" in page                                   # the drill-down's prompts mark the field


def test_pages_share_one_plotly_js(site):
    """One plotly.js in the site, loaded by every page with figures through a relative path that
    resolves to it from the page's own directory (so the site opens from file:// wherever it is
    moved); no page inlines it."""
    out, manifest = site
    scripts = [p for p in out.rglob("*.js")]
    assert [p.relative_to(out).as_posix() for p in scripts] == [manifest["plotly_js"]] == ["assets/plotly.min.js"]
    assert scripts[0].stat().st_size > 1_000_000 and "plotly.js" in scripts[0].read_text()[:2000]
    pages = sorted(out.rglob("*.html"))
    assert {p.relative_to(out).as_posix() for p in pages} == {"index.html"} | {p["page"] for p in manifest["pages"]}
    for path in pages:
        assert path.stat().st_size < 1_000_000, path                 # plotly.js (4.8 MB) is not inlined
        html_text = path.read_text()
        srcs = re.findall(r"<script[^>]*\bsrc=['\"]([^'\"]+)['\"]", html_text)
        if path.name == "index.html":
            continue                                                 # no figure: no script
        assert len(srcs) == 1 and not srcs[0].startswith(("/", "http:", "https:", "file:")), (path, srcs)
        assert (path.parent / srcs[0]).resolve() == scripts[0].resolve()
        assert "plotly.js v" not in html_text and len(re.findall(r"<script", html_text)) < 50


def test_blast_radius_page_has_its_share_curves_and_family_bars(site):
    """The sweep's blast_radius record gets the figures ``kvnotes plot`` draws from it: the share of
    positions above each threshold per family (a panel each) and the per-family deviation bars."""
    out, manifest = site
    page = next(p for p in manifest["pages"] if p["probe"] == "blast_radius")
    figs = {f["id"]: f for f in page["figures"]}
    rec = load_record(page["record"])
    fams = sorted(rec["result"]["examples"])
    assert figs["share-curves"]["kind"] == "curves" and figs["share-curves"]["traces"] == ["k_rel", "attn_rel"]
    assert figs["share-curves"]["panels"] == ["all", *fams]
    assert figs["family-deviation"]["categories"] == ["all", *fams]
    html_text = (out / page["page"]).read_text()
    for fig_id in ("share-curves", "family-deviation", "map-attn-0"):
        assert f'id="{fig_id}"' in html_text


#: A summary of ``kvnotes.harness.kit.summaries_by_family`` (mean, interval, flip share).
def _summary(mean: float) -> dict:
    return {"n": 4, "n_scenarios": 2, "mean": mean, "median": mean, "ci_mean": [mean - 0.1, mean + 0.1],
            "ci_method": "t_over_scenario_means", "decision_flipped": {"k": 1, "n": 4, "p": 0.25, "ci": [0.05, 0.7]}}


FAMILIES = ["lookup", "recall"]
GRID = [{"kind": "fraction", "value": 0.1}, {"kind": "fraction", "value": 1.0}, {"kind": "count", "value": 1},
        {"kind": "count", "value": 4}]


def _by_family(mean: float) -> dict:
    return {g: _summary(mean + 0.01 * i) for i, g in enumerate(["all", *FAMILIES])}


@pytest.fixture(scope="module")
def figures_site(tmp_path_factory):
    """A site of a suffix_recovery and a field_refresh record shaped as the probes write them."""
    from kvnotes.records.report import build_report
    from tests.cli.test_cli_errors import write_record

    runs = tmp_path_factory.mktemp("figure-runs")
    curves = {name: [_by_family(0.1 * i + 0.02 * j) | {"n_skipped_k_exceeds_downstream": 1} for i in range(len(GRID))]
              for j, name in enumerate(("suffix", "prefix", "topk", "random", "field+suffix"))}
    curves["topk"][1]["lookup"]["mean"] = 0.123456                    # one value to find in the page
    suffix = {"rows": [], "exclusions": {}, "excluded": [], "grid": GRID, "examples": {},
              "layer_bands": [{"name": "L0-14", "layers": list(range(15))}, {"name": "L15-29", "layers": [15]}],
              "aggregates": {"families": FAMILIES, "curves": {"heldout": curves, "all": {}},
                             "references": {n: _by_family(0.5) for n in ("none", "field", "downstream")},
                             "bands": [_by_family(0.2), _by_family(0.3)]}}
    refresh = {"rows": [], "exclusions": {}, "excluded": [], "variants": ["none", "field", "downstream"],
               "aggregates": {"families": FAMILIES, "recovery": {v: _by_family(0.4) for v in
                                                                  ("none", "field", "downstream", "field_downstream")}}}
    write_record(runs / "m" / "suffix_recovery" / "s", suffix, probe="suffix_recovery")
    write_record(runs / "m" / "field_refresh" / "s", refresh, probe="field_refresh")
    out = tmp_path_factory.mktemp("figure-site")
    return out, build_report([runs], out)


def test_suffix_recovery_page_has_its_k_curves(figures_site):
    """Recovery against k per set family, one figure per kind of k and a panel per family (the
    all-downstream reference dotted), and the per-family reference and layer-band bars."""
    out, manifest = figures_site
    page = next(p for p in manifest["pages"] if p["probe"] == "suffix_recovery")
    figs = {f["id"]: f for f in page["figures"]}
    for kind in ("fraction", "count"):
        fig = figs[f"k-curves-{kind}"]
        assert fig["panels"] == ["all", *FAMILIES]
        assert fig["traces"] == ["suffix", "prefix", "topk", "random", "field+suffix"]
        assert "heldout pairs" in fig["title"]
    assert figs["family-references"]["categories"] == ["all", *FAMILIES]
    assert figs["family-bands"]["categories"] == ["L0-14", "L15-29"]
    html_text = (out / page["page"]).read_text()
    assert 'id="k-curves-fraction"' in html_text and 'id="k-curves-count"' in html_text
    assert "0.123456" in html_text and "all downstream 0.50" in html_text


def test_field_refresh_page_has_its_family_bars(figures_site):
    """Mean recovery and the flipped share per family and patch (the checks by construction left out)."""
    out, manifest = figures_site
    page = next(p for p in manifest["pages"] if p["probe"] == "field_refresh")
    figs = {f["id"]: f for f in page["figures"]}
    for fig_id in ("family-recovery", "family-flipped"):
        assert figs[fig_id]["categories"] == ["all", *FAMILIES]
        assert figs[fig_id]["traces"] == ["field", "downstream", "field_downstream"]
        assert f'id="{fig_id}"' in (out / page["page"]).read_text()


def test_records_without_the_keys_get_no_such_figure(tmp_path):
    """A record of a known probe that lacks the keys its figures read (an older version) still gets
    a page, without those figures."""
    from kvnotes.records.report import build_report
    from tests.cli.test_cli_errors import SUMMARY, write_record

    write_record(tmp_path / "runs" / "suffix_recovery", {"rows": [], "aggregates": {"x": {"all": SUMMARY}}},
                 probe="suffix_recovery")
    manifest = build_report([tmp_path / "runs"], tmp_path / "site")
    assert [f["id"] for f in manifest["pages"][0]["figures"]] == ["aggregates"]


@pytest.fixture(scope="module")
def browser():
    if not BROWSER:
        if os.environ.get("CI"):
            pytest.fail("CI must install chromium and chromium-driver (.ci/run)")
        pytest.skip("no chromium / chromedriver on this machine")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium") or shutil.which("chromium-browser")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    yield driver
    driver.quit()


def _open(browser, out, page: dict) -> None:
    """Load a page: plotly.js came from the site's copy, no console error, every figure drawn."""
    browser.get((out / page["page"]).as_uri())
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, (page["page"], errors)
    assert browser.execute_script("return typeof Plotly") == "object", page["page"]
    n_plots = browser.execute_script("return document.querySelectorAll('.js-plotly-plot').length")
    assert n_plots == len(page["figures"]) > 0, page["page"]


def test_every_page_opens_offline_without_console_errors(site, browser, sweep):
    out, manifest = site
    browser.get((out / "index.html").as_uri())
    assert len(browser.find_elements("css selector", "table tr")) == len(manifest["pages"]) + 1
    browser.save_screenshot(str(out / "index.png"))
    for p in manifest["pages"]:
        _open(browser, out, p)
        rec = load_record(p["record"])
        for fig in p["figures"]:
            if fig["kind"] != "token_strip":
                continue
            data = browser.execute_script(f"var d = document.getElementById('{fig['id']}').data[0];"
                                          "return {x: d.x.length, z: d.z[0]};")
            prompt = rec["prompts"][fig["pair"]]
            assert data["x"] == fig["n_tokens"] == len(prompt["tokens"])        # one cell per prompt token
            ex = next(e for e in rec["result"]["examples"].values() if e["pair"] == fig["pair"])
            maps = ex["maps"]["k_rel"]
            i = prompt["decision"] - 1                                          # the last downstream token
            assert data["z"][i] == pytest.approx(sum(row[i] for row in maps) / len(maps), rel=1e-6)
        if p["probe"] == "blast_radius":
            browser.save_screenshot(str(out / "page.png"))
    assert (out / "index.png").stat().st_size > 10_000 and (out / "page.png").stat().st_size > 10_000


def test_figure_pages_open_offline_without_console_errors(figures_site, browser):
    """The per-family bars and the curves over k draw in the browser, panels and all."""
    out, manifest = figures_site
    for p in manifest["pages"]:
        _open(browser, out, p)
        for fig in p["figures"]:
            if fig["kind"] == "curves":
                n_axes = browser.execute_script(f"var l = document.getElementById('{fig['id']}').layout;"
                                                "return Object.keys(l).filter(k => /^xaxis\\d*$/.test(k)).length;")
                assert n_axes == len(fig["panels"]), fig["id"]
