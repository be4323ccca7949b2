"""The OpenAPI surface as its users meet it: the committed document is valid OpenAPI 3.x
and is what the server serves, /docs is Swagger UI served entirely by visiongate, and a
client generated from the document by a real generator classifies photos."""

import html.parser
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest
import requests
from openapi_spec_validator import validate

from conftest import PHOTOS, ROOT

DOCUMENT = ROOT / "openapi" / "openapi.json"


def test_committed_document_is_valid_openapi():
    spec = json.loads(DOCUMENT.read_text())
    assert spec["openapi"].startswith("3.")
    validate(spec)  # raises on any violation of the OpenAPI schema


def test_server_serves_the_committed_document(server):
    served = requests.get(server.base + "/openapi.json", timeout=10)
    assert served.status_code == 200
    assert served.json() == json.loads(DOCUMENT.read_text())


class _Assets(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.urls.append(value)


def test_docs_are_swagger_ui_served_by_visiongate_alone(server):
    page = requests.get(server.base + "/docs", timeout=10)  # redirects to /docs/
    assert page.status_code == 200 and page.url.endswith("/docs/")
    assert "swagger-ui" in page.text
    parser = _Assets()
    parser.feed(page.text)
    assert len(parser.urls) >= 4, parser.urls
    for ref in parser.urls:
        url = urljoin(page.url, ref)
        assert urlparse(url).netloc == urlparse(server.base).netloc, f"{ref} leaves the machine"
        assert requests.get(url, timeout=10).status_code == 200, url
    init = requests.get(urljoin(page.url, "swagger-initializer.js"), timeout=10).text
    # The document from this server, and no online validator badge.
    assert '"url": "/openapi.json"' in init and '"validatorUrl": "none"' in init, init


@pytest.fixture(scope="module")
def generated_client(tmp_path_factory):
    """`openapi-python-client` (PyPI) generates a package from the committed document."""
    out = tmp_path_factory.mktemp("generated")
    generator = Path(sys.executable).parent / "openapi-python-client"
    subprocess.run(
        [str(generator), "generate", "--path", str(DOCUMENT), "--meta", "none",
         "--output-path", str(out / "visiongate_client")],
        check=True, cwd=out, capture_output=True, timeout=300,
    )
    sys.path.insert(0, str(out))
    import visiongate_client

    yield visiongate_client
    sys.path.remove(str(out))


def test_generated_client_classifies_photos_and_reports_a_broken_file(server, generated_client):
    from visiongate_client import Client
    from visiongate_client.api.kserve import model_metadata
    from visiongate_client.api.predict import predict
    from visiongate_client.models import ErrorBody, FileFailure, Prediction, PredictResponse, PredictUpload
    from visiongate_client.types import File

    client = Client(base_url=server.base, timeout=120)
    files = [
        File(payload=(PHOTOS / "small" / "sk_chelsea.jpg").open("rb"), file_name="sk_chelsea.jpg", mime_type="image/jpeg"),
        File(payload=(PHOTOS / "small" / "sk_coffee.jpg").open("rb"), file_name="sk_coffee.jpg", mime_type="image/jpeg"),
        File(payload=open(__file__, "rb"), file_name="broken.jpg", mime_type="image/jpeg"),
    ]
    reply = predict.sync(client=client, body=PredictUpload(files=files), top_k=3)
    assert isinstance(reply, PredictResponse), reply
    chelsea, coffee, broken = reply.results
    assert isinstance(chelsea, Prediction) and isinstance(coffee, Prediction)
    assert "cat" in chelsea.label and chelsea.class_id in (281, 282, 283, 284, 285)
    assert coffee.label == "espresso" and 0 < coffee.score <= 1
    assert [t.class_id for t in coffee.top_k][0] == coffee.class_id and len(coffee.top_k) == 3
    assert isinstance(broken, FileFailure)
    assert broken.filename == "broken.jpg" and broken.error.code == "invalid_image"
    assert reply.timing.total_images == 3

    # Errors come back typed too.
    missing = predict.sync(client=client, body=PredictUpload(files=files[:1]), model="resnet50")
    assert isinstance(missing, ErrorBody) and missing.code == "not_found" and "resnet50" in missing.error
    meta = model_metadata.sync(client=client, model="classifier")
    assert meta.platform == "pytorch_libtorch" and meta.inputs[0].shape == [-1, 3, 224, 224]
