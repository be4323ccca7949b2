"""The upload page as a person uses it: Debian's chromium, driven by playwright-core from npm
(tests/browser/upload.mjs), uploads three photos and a broken file to the real server and
must show each label, the error, the summary, and keyboard reach; screenshots are left in
test-artifacts/ (upload-page.png, upload-page-phone.png, docs.png)."""

import json
import os
import subprocess

import pytest

from conftest import PHOTOS, ROOT, require_tool

ARTIFACTS = ROOT / "test-artifacts"
SCRIPT = ROOT / "tests" / "browser" / "upload.mjs"


@pytest.fixture(scope="module")
def page_run(server, tmp_path_factory):
    chromium = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    require_tool(chromium)
    require_tool("node")
    broken = tmp_path_factory.mktemp("upload") / "holiday.jpg"
    broken.write_bytes(b"\xff\xd8\xff\xe0 this is not really a JPEG" * 20)
    photos = [PHOTOS / "small" / n for n in ["sk_chelsea.jpg", "sk_coffee.jpg", "LadyBird.jpg"]]
    # 1000 files in one go, as the page promises (the three photos, over and over).
    many = tmp_path_factory.mktemp("many")
    for i in range(1000):
        (many / f"photo-{i:04d}.jpg").symlink_to(photos[i % 3])
    ARTIFACTS.mkdir(exist_ok=True)
    r = subprocess.run(
        ["node", str(SCRIPT), server.base, str(ARTIFACTS), *map(str, photos), str(broken)],
        capture_output=True, text=True, timeout=900, cwd=SCRIPT.parent,
        env={**os.environ, "MANY_DIR": str(many)},
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_page_shows_labels_scores_bars_and_the_error(page_run):
    cards = {c["filename"]: c for c in page_run["cards"]}
    assert list(cards) == ["sk_chelsea.jpg", "sk_coffee.jpg", "LadyBird.jpg", "holiday.jpg"]
    assert "cat" in cards["sk_chelsea.jpg"]["label"]
    assert cards["sk_coffee.jpg"]["label"] == "espresso"
    assert cards["LadyBird.jpg"]["label"] == "ladybug"  # the first of the label's synonyms
    assert cards["LadyBird.jpg"]["fullLabel"].startswith("ladybug, ladybeetle")
    for name in ["sk_chelsea.jpg", "sk_coffee.jpg", "LadyBird.jpg"]:
        assert cards[name]["score"].endswith("%") and cards[name]["bars"] == 3
        assert cards[name]["problem"] is None and cards[name]["thumbnailLoaded"]
    problem = cards["holiday.jpg"]["problem"]
    assert problem.startswith("Could not classify") and "invalid_image" in problem
    assert cards["holiday.jpg"]["label"] is None and not cards["holiday.jpg"]["thumbnailLoaded"]


def test_page_summarises_and_announces(page_run):
    assert page_run["chosen"] == "4 images chosen"
    summary = page_run["summary"]
    assert summary[0] == "4 images" and summary[1].endswith(" s") and summary[2].endswith("images/s")
    assert summary[3] == "1 error"
    assert page_run["status"] == "Done: 3 classified, 1 could not be read."


def test_page_is_keyboard_usable_and_fits_a_phone(page_run):
    order = page_run["tabOrder"]
    assert order.index("files") < order.index("topk") < order.index("classify"), order
    assert not page_run["phoneOverflow"], "the page scrolls sideways at 390 px"


def test_nothing_leaves_the_machine_and_docs_render(page_run):
    assert page_run["outside"] == []
    assert page_run["consoleErrors"] == []
    assert page_run["docsTitle"].startswith("visiongate") and page_run["docsOperations"] >= 10
    for shot in ["upload-page.png", "upload-page-phone.png", "docs.png"]:
        assert (ARTIFACTS / shot).stat().st_size > 10_000, shot


def test_page_takes_1000_images_at_once(page_run):
    many = page_run["many"]
    assert many["chosen"] == "1000 images chosen"
    assert many["cards"] == 1000 and many["failed"] == 0
    assert many["labels"][0] == "Egyptian cat" and many["labels"][1] == "espresso"
    assert many["summary"][0] == "1000 images" and many["summary"][3] == "0 errors"
    print(f"1000 images through the page in {many['seconds']:.1f} s")
