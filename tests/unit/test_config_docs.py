"""docs/configuration.md is the output of `verst config docs`: the committed page matches the schema."""

from pathlib import Path

from verst.cli.config_docs import REGENERATE, render
from verst.config import iter_fields

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_page_is_current():
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date with the schema; run: {REGENERATE}"


def test_every_field_is_on_the_page():
    text = render()
    for dotted, _, _, doc in iter_fields():
        assert f"| `{dotted.rsplit('.', 1)[-1]}` |" in text and doc.replace("|", "\\|") in text, dotted


def test_the_generator_imports_no_torch():
    import subprocess
    import sys

    code = "import sys; from verst.cli.main import main; main(['config', 'docs']); assert 'torch' not in sys.modules"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == render()
