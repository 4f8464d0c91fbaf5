"""The HTML report, built from records of a real embedded-model run (the command-line sweep), loaded
page by page in a real headless Chromium: no console errors, the expected figures present, a token
strip as long as the pair's prompt, a hover value equal to the record's number."""

from __future__ import annotations

import json
import os
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
        assert "<script" in page and "<script src" not in page            # plotly.js inlined: no network
        raw = out / "records" / p["page"].replace(".html", ".json")
        assert json.loads(raw.read_text())["probe"] == p["probe"]
        assert "<mark" in page                                   # the drill-down's prompts mark the field


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


def test_every_page_opens_offline_without_console_errors(site, browser, sweep):
    out, manifest = site
    browser.get((out / "index.html").as_uri())
    assert len(browser.find_elements("css selector", "table tr")) == len(manifest["pages"]) + 1
    browser.save_screenshot(str(out / "index.png"))
    for p in manifest["pages"]:
        browser.get((out / p["page"]).as_uri())
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, (p["page"], errors)
        n_plots = browser.execute_script("return document.querySelectorAll('.js-plotly-plot').length")
        assert n_plots == len(p["figures"]) > 0, p["page"]
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
