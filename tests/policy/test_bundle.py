"""PolicyBundle: the content revision, round trips, and damaged or malformed bundles refused."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nexuskv.policy.bundle import BundleError, PolicyBundle, bundle_revision
from nexuskv.policy.loader import Policies, PolicyError
from tests.policy.test_loader import write

GOOD = {"default.toml": 'name = "default"\n[[reuse]]\nname = "short"\nwhen = "match.tokens < 16"\n',
        "tenants/acme.toml": 'name = "acme"\nmin_gain_ms = 1.0\n'}


def test_the_bundle_revision_is_the_directory_revision(tmp_path):
    root = write(tmp_path, GOOD)
    bundle = PolicyBundle.from_directory(root, note="first")
    assert bundle.revision == Policies.load(root).revision == bundle_revision(GOOD)
    assert Policies.from_bundle(bundle).revision == bundle.revision
    assert sorted(bundle.files) == ["default.toml", "tenants/acme.toml"] and bundle.note == "first"


def test_json_round_trip_checks_the_revision():
    bundle = PolicyBundle(GOOD, note="n")
    back = PolicyBundle.from_json(bundle.to_json())
    assert back == bundle
    data = json.loads(bundle.to_json())
    data["files"]["default.toml"] += "\n# edited on the way\n"
    with pytest.raises(BundleError, match="does not match its content"):
        PolicyBundle.from_json(json.dumps(data))


@pytest.mark.parametrize(("text", "message"), [
    ("{", "not JSON"),
    ('{"format": "other"}', "not a policy bundle"),
    ('{"format": "nexuskv-policy-bundle/1", "files": {"a.toml": 1}, "revision": "x"}', "map relative paths"),
    ('{"format": "nexuskv-policy-bundle/1", "files": {}, "revision": ""}', "no revision"),
    ('{"format": "nexuskv-policy-bundle/1", "files": {}, "revision": "x", "created_at": "yesterday"}',
     "must be a number"),
])  # fmt: skip
def test_malformed_bundles_are_refused(text, message):
    with pytest.raises(BundleError, match=message):
        PolicyBundle.from_json(text)


@pytest.mark.parametrize("rel", ["../etc/passwd.toml", "/abs.toml", "x.txt", "a/b.toml", "tenants/a/b.toml"])
def test_paths_outside_the_layout_are_refused(rel):
    with pytest.raises(BundleError, match=r"expected NAME\.toml"):
        PolicyBundle({rel: "name = 'x'"})


def test_problems_of_a_bundle_name_the_bundle_file():
    bundle = PolicyBundle({**GOOD, "tenants/acme.toml": 'name = "acme"\n[[reuse]]\nname = "bad"\nwhen = "1"\n'})
    with pytest.raises(PolicyError) as err:
        Policies.from_bundle(bundle)
    (p,) = err.value.problems
    assert p.file == f"bundle:{bundle.revision}/tenants/acme.toml" and p.rule == "bad" and p.line == 4


def test_write_to_gives_a_loadable_directory(tmp_path):
    bundle = PolicyBundle(GOOD)
    assert Policies.load(bundle.write_to(tmp_path / "out")).revision == bundle.revision


def test_from_directory_errors(tmp_path):
    with pytest.raises(BundleError, match="no such policy directory"):
        PolicyBundle.from_directory(tmp_path / "missing")
    with pytest.raises(BundleError, match="no policy files"):
        PolicyBundle.from_directory(tmp_path)


@given(st.dictionaries(st.sampled_from(["default.toml", "tenants/a.toml", "b.toml"]), st.text(max_size=40),
                       min_size=1))  # fmt: skip
def test_the_revision_changes_with_any_file_and_only_with_content(files):
    rev = bundle_revision(files)
    assert rev == bundle_revision(dict(reversed(list(files.items()))))
    for rel in files:
        assert bundle_revision({**files, rel: files[rel] + " "}) != rev
