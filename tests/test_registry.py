"""Registry: schema errors, the adapter/status rule, fingerprint consistency, resolution, extra files, lock."""

from __future__ import annotations

import json
import os
import re
from importlib.resources import files
from pathlib import Path

import pytest
import yaml
from dflash_zoo.adapters import canonical_model_type, find_adapter

from dflash_zoo.engine.config import default_target_layer_ids
from dflash_zoo.errors import ConfigError, NotFoundError
from dflash_zoo.paths import zoo_home
from dflash_zoo.zoo import registry as reg_mod
from dflash_zoo.zoo.registry import load_registry, read_lock, write_lock

PUBLISHED = (
    "qwen3-4b qwen3-8b llama3.1-8b-instruct qwen3-coder-30b-a3b qwen3-coder-next gpt-oss-20b gpt-oss-120b "
    "qwen3.5-4b qwen3.5-9b qwen3.5-27b qwen3.5-35b-a3b qwen3.5-122b-a10b qwen3.6-27b qwen3.6-35b-a3b "
    "kimi-k2.5 minimax-m2.5 gemma4-31b-it gemma4-26b-a4b-it qwen3.5-397b-a17b qwen3.8-27b muse-glimmer-30b "
    "kimi-k2.6 minimax-m2.7 glm-5.1-fp8 glm-5.3 gemma4-12b-it kimi-k2.7-code laguna-s-2.1 laguna-xs-2.1 "
    "glm-5.3-flash alpamayo-r1-10b alpamayo-1.5-10b"
).split()
MARKED = {"glm-5.3-flash", "alpamayo-r1-10b", "alpamayo-1.5-10b"}  # listed, not runnable: the author's status
SHAPE_NOT_PUBLIC = {"alpamayo-r1-10b", "alpamayo-1.5-10b"}  # no public config gives their target's text shape
# taps that do not follow the default rule (docs/method.md §2)
EXPLICIT_TAPS = {"qwen3-coder-next", "qwen3.8-27b", "laguna-s-2.1", "laguna-xs-2.1", "alpamayo-1.5-10b"}
FIXTURES = Path(__file__).parent / "fixtures" / "configs"


def entry_dict(slug: str = "custom", **over) -> dict:
    """A valid extra-registry entry (a Qwen3-8B-shaped pair); `over` replaces top-level fields."""
    base = {
        "slug": slug,
        "adapter": "qwen3",
        "target": {"repo": f"me/{slug}-target", "model_type": "qwen3", "hidden_size": 4096,
                   "num_hidden_layers": 36, "vocab_size": 151936},
        "draft": {"repo": f"me/{slug}-draft", "revision": "main", "architecture": "dflash", "block_size": 16,
                  "target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669, "num_layers": 5},
        "license": "apache-2.0",
        "status": "supported",
    }  # fmt: skip
    base.update(over)
    return base


def write_extra(tmp_path: Path, *entries: dict) -> Path:
    path = tmp_path / "extra.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "entries": list(entries)}))
    return path


pytestmark = pytest.mark.usefixtures("offline_zoo_home")


@pytest.fixture(scope="module")
def registry():
    return load_registry()


# ---- the built-in file ------------------------------------------------------------------------------


def test_builtin_file_is_packaged_and_complete(registry):
    assert (files("dflash_zoo") / "registry.yaml").is_file()
    assert os.path.islink(Path(__file__).parents[1] / "dflash_zoo" / "registry.yaml")
    assert [e.slug for e in registry] == PUBLISHED


@pytest.mark.parametrize("slug", PUBLISHED)
def test_adapter_rule(registry, slug):
    """supported/preview only when the adapter exists; otherwise unsupported-here with a reason (the author's
    own for an entry marked so, else the missing adapter)."""
    e = registry.resolve(slug)
    assert (e.declared_status == "unsupported-here") == (slug in MARKED)
    if slug in MARKED:
        assert e.status == "unsupported-here" and e.reason and "no adapter for model_type" not in e.reason
    elif find_adapter(e.adapter) is None:
        assert e.status == "unsupported-here"
        assert e.reason == f"no adapter for model_type {e.adapter} in this install"
    else:
        assert e.status in ("supported", "preview")
    assert e.status == "supported" or e.reason


@pytest.mark.parametrize("slug", PUBLISHED)
def test_fingerprint_self_consistent(registry, slug):
    e = registry.resolve(slug)
    t, d = e.target, e.draft
    assert canonical_model_type(e.adapter) == canonical_model_type(t.model_type)
    assert t.known == (slug not in SHAPE_NOT_PUBLIC)
    if not t.known:  # nothing to bound the taps and mask id by; the notes say why the shape is null
        assert e.status == "unsupported-here" and "not public" in e.reason and "no public config" in e.notes
    if d.target_layer_ids is not None:
        assert 0 <= min(d.target_layer_ids) and (not t.known or max(d.target_layer_ids) < t.num_hidden_layers)
        if slug not in EXPLICIT_TAPS:
            assert list(d.target_layer_ids) == default_target_layer_ids(
                t.num_hidden_layers, len(d.target_layer_ids)
            )
    if d.mask_token_id is not None:
        assert d.mask_token_id < t.vocab_size
    if d.block_size is not None:
        assert d.block_size >= 2
    unknown = [k for k, v in vars(d).items() if v is None]
    assert not unknown or "unknown" in e.notes or "unverified" in e.notes or e.status != "supported"
    assert e.draft_revision == "main" or len(e.draft_revision) == 40


def test_facts_from_families(registry):
    assert registry.resolve("llama3.1-8b-instruct").draft.block_size == 10
    assert registry.resolve("gpt-oss-20b").draft.block_size == 8
    assert registry.resolve("kimi-k2.5").draft.mask_token_id == 163838
    assert registry.resolve("gemma4-31b-it").draft.mask_token_id == 4
    mm = registry.resolve("minimax-m2.5")
    assert mm.gated and mm.draft.block_size is None and mm.draft.target_layer_ids is None
    assert registry.resolve("llama3.1-8b-instruct").gated
    assert registry.resolve("qwen3-8b").chat_template_kwargs == {"enable_thinking": False}


def test_laguna_xs_and_gemma4_12b_drafter_facts(registry):
    """Laguna-XS-2.1's drafter pinned at the commit whose config and byte count are public; Gemma 4 12B's
    config from a single third-party source, which its notes name. Each byte count is its bf16 parameters
    (docs/families.md) plus a safetensors header of a few KB."""
    xs = registry.resolve("laguna-xs-2.1")
    assert xs.draft_revision == xs.revisions[0].commit == "5c36361aab23c8ed3afbd079c10c426b677bc607"
    assert (xs.draft.num_layers, xs.draft.mask_token_id, xs.revisions[0].sliding_window) == (5, 12, 512)
    assert xs.shape_from is None and xs.draft_license == "openmdw-1.1"
    g12 = registry.resolve("gemma4-12b-it")
    assert (g12.draft.num_layers, g12.draft.mask_token_id, g12.draft.block_size) == (5, 4, 16)
    assert "single third-party source" in g12.notes and "Crssz/r4dx" in g12.notes
    for entry, params in ((xs, 462_064_896), (g12, 727_496_960)):
        assert 0 < entry.draft_size_bytes - 2 * params < 10_000, entry.slug
        assert entry.status == "supported" and entry.reason is None


# ---- schema -----------------------------------------------------------------------------------------

BAD = [
    ({"colour": "red"}, "colour"),
    ({"license": None}, "license"),
    ({"status": "beta"}, "status"),
    ({"status": "preview"}, "reason"),
    ({"gated": "yes"}, "gated"),
    ({"aliases": "x"}, "aliases"),
    ({"target": {"repo": "a/b", "model_type": "qwen3", "hidden_size": "4096", "num_hidden_layers": 36,
                 "vocab_size": 151936}}, "target.hidden_size"),
    ({"target": {"repo": "a/b", "model_type": "qwen3", "hidden_size": 4096, "num_hidden_layers": 36}},
     "target.vocab_size"),
]  # fmt: skip


@pytest.mark.parametrize("over,field", BAD)
def test_schema_errors_name_entry_and_field(tmp_path, over, field):
    raw = entry_dict("broken", **over)
    if over.get("license", 1) is None:
        del raw["license"]
    with pytest.raises(ConfigError) as err:
        load_registry(write_extra(tmp_path, raw))
    assert "'broken'" in str(err.value) and field in str(err.value)


@pytest.mark.parametrize(
    "draft_over,field",
    [
        ({"block_size": 1}, "draft.block_size"),
        ({"target_layer_ids": [1, 36]}, "draft.target_layer_ids"),
        ({"mask_token_id": 151936}, "draft.mask_token_id"),
        ({"num_layers": True}, "draft.num_layers"),
        ({"flavour": 1}, "draft.flavour"),
    ],
)
def test_schema_draft_errors(tmp_path, draft_over, field):
    raw = entry_dict("broken")
    raw["draft"].update(draft_over)
    with pytest.raises(ConfigError, match=rf"'broken'.*{field}"):
        load_registry(write_extra(tmp_path, raw))


def test_unknown_draft_facts_must_be_explicit_null(tmp_path):
    raw = entry_dict("vague")
    del raw["draft"]["mask_token_id"]
    with pytest.raises(ConfigError, match=r"'vague'.*draft.mask_token_id.*null if unknown"):
        load_registry(write_extra(tmp_path, raw))
    raw["draft"].update(mask_token_id=None, block_size=None, target_layer_ids=None, num_layers=None)
    e = load_registry(write_extra(tmp_path, raw)).resolve("vague")
    assert e.draft.block_size is None and e.draft.target_layer_ids is None


def test_bad_documents(tmp_path):
    path = tmp_path / "extra.yaml"
    for text, match in [
        ("entries: [", "not valid YAML"),
        ("- a\n", "'entries' list"),
        ("entries: [3]", "#0"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=match):
            load_registry(path)


SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "vocab_size")


@pytest.mark.parametrize("status", ["supported", "preview"])
@pytest.mark.parametrize("key", SHAPE_KEYS)
def test_null_target_shape_only_on_unsupported_here(tmp_path, status, key):
    """A null (not public) target shape fact is refused on a runnable entry, naming the entry and field."""
    raw = entry_dict("shapeless", status=status, reason="why" if status == "preview" else None)
    raw["target"][key] = None
    with pytest.raises(ConfigError, match=rf"'shapeless'.*'target\.{key}' is null.*'unsupported-here'"):
        load_registry(write_extra(tmp_path, raw))


def unsupported_dict(slug: str = "listed", **target_over) -> dict:
    """An entry marked unsupported-here whose target shape is not public (null), with its reason and notes."""
    why = {"reason": "no class builds the target", "notes": "shape not public"}
    raw = entry_dict(slug, status="unsupported-here", **why)
    raw["target"].update(dict.fromkeys(SHAPE_KEYS), **target_over)
    return raw


def test_unsupported_here_entry_may_leave_the_target_shape_null(tmp_path):
    e = load_registry(write_extra(tmp_path, unsupported_dict())).resolve("listed")
    assert (e.target.hidden_size, e.target.num_hidden_layers, e.target.vocab_size) == (None, None, None)
    assert not e.target.known and e.status == e.declared_status == "unsupported-here"
    assert e.reason == "no class builds the target"
    reg = load_registry(write_extra(tmp_path, unsupported_dict()))
    assert reg.by_fingerprint("qwen3", None, None, None) == []  # an unknown shape matches no config


@pytest.mark.parametrize(
    "over,message",
    [
        ({"notes": None}, r"'listed'.*'notes' must say why"),
        ({"draft_over": {"target_layer_ids": [-1, 3]}}, r"'listed'.*draft\.target_layer_ids.*\[0, \.\.\.\)"),
        ({"draft_over": {"mask_token_id": -2}}, r"'listed'.*draft\.mask_token_id.*-2"),
        ({"target_over": {"hidden_size": 0}}, r"'listed'.*target\.hidden_size.*positive"),
    ],
)
def test_unknown_shape_still_checks_what_it_can(tmp_path, over, message):
    """Notes must explain the null shape; taps and mask ids stay non-negative, with nothing to bound them."""
    raw = unsupported_dict(**over.get("target_over", {}))
    raw["draft"].update(over.get("draft_over", {}))
    if "notes" in over:
        del raw["notes"]
    with pytest.raises(ConfigError, match=message):
        load_registry(write_extra(tmp_path, raw))
    raw = unsupported_dict()
    raw["draft"].update(target_layer_ids=[24, 300], mask_token_id=None)  # no depth known to bound them
    assert load_registry(write_extra(tmp_path, raw)).resolve("listed").draft.target_layer_ids == (24, 300)


def test_missing_shape_field_says_when_it_may_be_null(tmp_path):
    raw = entry_dict("vague")
    del raw["target"]["vocab_size"]
    with pytest.raises(ConfigError, match=r"missing field 'target\.vocab_size' \(null if not public: "):
        load_registry(write_extra(tmp_path, raw))


def test_refuse_unrunnable_only_for_entries_marked_so(tmp_path):
    """The author's unsupported-here is refused with its reason; a downgrade for a missing adapter is not."""
    from dflash_zoo.errors import UnsupportedModelError

    future = entry_dict("future", adapter="no_such_family")
    reg = load_registry(write_extra(tmp_path, unsupported_dict(), future))
    reg_mod.refuse_unrunnable(reg.resolve("future"))  # downgraded only: the engines can still serve it
    with pytest.raises(UnsupportedModelError, match="listed is marked unsupported here: no class") as err:
        reg_mod.refuse_unrunnable(reg.resolve("listed"))
    assert "dflash-zoo info listed" in err.value.hint


def test_missing_adapter_downgrades(tmp_path):
    e = load_registry(write_extra(tmp_path, entry_dict("future", adapter="no_such_family"))).resolve("future")
    assert e.status == "unsupported-here"
    assert e.reason == "no adapter for model_type no_such_family in this install"


# ---- resolution ---------------------------------------------------------------------------------------


def test_resolution_by_each_name_kind(registry):
    assert registry.lookup("qwen3-8b")[1] == "slug"
    assert registry.lookup("QWEN3:8B")[1] == "alias"
    assert registry.lookup("qwen/qwen3-8b") == (registry.resolve("qwen3-8b"), "target")
    assert registry.lookup("z-lab/Qwen3-8B-DFlash-b16")[1] == "draft"
    assert registry.lookup("meta-llama/Llama-3.1-8B") == (registry.resolve("llama3.1-8b-instruct"), "variant")


def test_resolution_order(tmp_path):
    """An alias beats another entry's target repo; a target repo beats another entry's variant."""
    extra = write_extra(
        tmp_path,
        entry_dict("aliased", aliases=["Qwen/Qwen3-8B"]),
        entry_dict("base-pair", target={**entry_dict()["target"], "repo": "Qwen/Qwen3-8B-Base"}),
    )
    reg = load_registry(extra)
    assert reg.lookup("Qwen/Qwen3-8B")[0].slug == "aliased"
    assert reg.lookup("Qwen/Qwen3-8B-Base")[0].slug == "base-pair"


@pytest.mark.parametrize("name", ["qwen3", "Qwen/Qwen3-8", "qwen3-8b-extra", "wen3-8b", "z-lab", "8b", ""])
def test_never_substring_or_prefix(registry, name):
    with pytest.raises(NotFoundError):
        registry.resolve(name)


def test_unknown_name_suggests_nearest(registry):
    with pytest.raises(NotFoundError) as err:
        registry.resolve("qwen3-7b")
    assert "qwen3-7b" in str(err.value)
    assert "qwen3-8b" in err.value.hint
    with pytest.raises(NotFoundError) as err:
        registry.resolve("zzzzzzzz")
    assert "dflash-zoo list" in err.value.hint


def test_by_fingerprint(registry):
    assert [e.slug for e in registry.by_fingerprint("qwen3", 4096, 36, 151936)] == ["qwen3-8b"]
    assert [e.slug for e in registry.by_fingerprint("llama", 4096, 32, 128256)] == ["llama3.1-8b-instruct"]
    same = [e.slug for e in registry.by_fingerprint("qwen3_5", 5120, 64, 248320)]
    assert same == ["qwen3.5-27b", "qwen3.6-27b", "qwen3.8-27b"]  # one shape, three generations
    assert [e.slug for e in registry.by_fingerprint("kimi_k25", 7168, 61, 163840)] == [
        "kimi-k2.5",
        "kimi-k2.6",
        "kimi-k2.7-code",
    ]
    assert registry.by_fingerprint("qwen3", 4096, 32, 151936) == []


def test_match_glob(registry):
    assert [e.slug for e in registry.match("qwen3.5*")][:2] == ["qwen3.5-4b", "qwen3.5-9b"]
    assert len(registry.match("qwen3.5*")) == 6
    assert [e.slug for e in registry.match("GOOGLE/*")] == [
        "gemma4-31b-it",
        "gemma4-26b-a4b-it",
        "gemma4-12b-it",
    ]
    assert registry.match("qwen3") == []  # a glob, not a substring
    assert len(registry.match(None)) == len(registry)


# ---- extra registry -----------------------------------------------------------------------------------


def test_extra_registry_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_ZOO_REGISTRY", str(write_extra(tmp_path, entry_dict("mine", aliases=["m:1"]))))
    reg = load_registry()
    assert reg.entries[-1].slug == "mine" and reg.resolve("m:1").slug == "mine"
    assert len(reg) == len(PUBLISHED) + 1


@pytest.mark.parametrize("over", [{"slug": "qwen3-8b"}, {"aliases": ["QWEN3:8B"]}])
def test_duplicate_names_both_entries(tmp_path, monkeypatch, over):
    raw = {**entry_dict("dupe"), **over}
    monkeypatch.setenv("DFLASH_ZOO_REGISTRY", str(write_extra(tmp_path, raw)))
    with pytest.raises(ConfigError) as err:
        load_registry()
    msg = str(err.value)
    assert "'qwen3-8b'" in msg and f"'{raw['slug']}'" in msg and "built-in" in msg


def test_an_extra_file_that_is_not_utf8_or_is_a_folder_is_named(tmp_path, monkeypatch):
    bad = tmp_path / "extra.yaml"
    bad.write_bytes(b"version: 1\n# caf\xe9\nentries: []\n")
    monkeypatch.setenv("DFLASH_ZOO_REGISTRY", str(bad))
    with pytest.raises(ConfigError, match=r"extra\.yaml is not valid UTF-8 \(byte 16: 0xe9\)"):
        load_registry()
    monkeypatch.setenv("DFLASH_ZOO_REGISTRY", str(tmp_path))
    with pytest.raises(ConfigError, match="is a directory"):
        load_registry()


@pytest.mark.parametrize("record", ['"z-lab/Qwen3-8B-DFlash-b16"', '{"draft_repo": "r", "draft_commit": 5}'])
def test_a_lock_record_of_the_wrong_shape_is_one_line(tmp_path, monkeypatch, record):
    from dflash_zoo.zoo.registry import read_lock

    monkeypatch.setenv("DFLASH_ZOO_HOME", str(tmp_path))
    (tmp_path / "lock.json").write_text(f'{{"qwen3-8b": {record}}}')
    with pytest.raises(ConfigError, match="the record of 'qwen3-8b' is not an object of strings") as err:
        read_lock()
    assert "delete" in err.value.hint


def test_hf_home_expands_variables_as_huggingface_hub_does(tmp_path, monkeypatch):
    from dflash_zoo.zoo import hub

    monkeypatch.setenv("BIGDISK", str(tmp_path))
    monkeypatch.setenv("HF_HOME", "$BIGDISK/hf")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    assert hub.hf_home() == tmp_path / "hf" and hub.hub_cache_dir() == tmp_path / "hf" / "hub"


def test_missing_extra_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_ZOO_REGISTRY", str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_registry()


# ---- zoo home and lock --------------------------------------------------------------------------------


def test_zoo_home_precedence(tmp_path, monkeypatch):
    assert zoo_home() == tmp_path / "zoo"
    monkeypatch.delenv("DFLASH_ZOO_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert zoo_home() == tmp_path / "xdg" / "dflash-zoo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert zoo_home() == Path.home() / ".cache" / "dflash-zoo"


def test_lock_round_trip(tmp_path):
    assert read_lock() == {}
    write_lock("qwen3-8b", "z-lab/Qwen3-8B-DFlash-b16", "main", "a" * 40)
    write_lock("gpt-oss-20b", "z-lab/gpt-oss-20b-DFlash", "main", "b" * 40)
    write_lock("qwen3-8b", "z-lab/Qwen3-8B-DFlash-b16", "main", "c" * 40)
    lock = read_lock()
    assert set(lock) == {"qwen3-8b", "gpt-oss-20b"}
    assert lock["qwen3-8b"]["commit"] == "c" * 40 and lock["qwen3-8b"]["requested_revision"] == "main"
    assert lock["qwen3-8b"]["draft_repo"] == "z-lab/Qwen3-8B-DFlash-b16" and lock["qwen3-8b"]["pulled_at"]
    assert sorted(p.name for p in (tmp_path / "zoo").iterdir()) == ["lock.json"]  # no temp files left
    assert json.loads(reg_mod.lock_path().read_text()) == lock


def test_corrupt_lock_is_a_clear_error(tmp_path):
    reg_mod.lock_path().parent.mkdir(parents=True)
    reg_mod.lock_path().write_text("{not json")
    with pytest.raises(ConfigError, match="lock.json") as err:
        read_lock()
    assert "delete" in err.value.hint


# ---- pins, licences, gates, sizes -------------------------------------------------------------------


def test_revisions_are_main_or_pinned_and_say_so(registry):
    """A revision is "main" (no commit known, and the entry says so) or a full commit (the entry says pinned)."""
    text = (Path(__file__).parents[1] / "registry.yaml").read_text()
    pinned = {e.slug for e in registry if e.draft_revision != "main"}
    assert pinned == {
        "qwen3.8-27b", "muse-glimmer-30b", "kimi-k2.6", "minimax-m2.7", "laguna-s-2.1", "laguna-xs-2.1"
    }  # fmt: skip
    for e in registry:
        assert e.target_revision == "main"
        assert e.draft_revision == "main" or re.fullmatch(r"[0-9a-f]{40}", e.draft_revision), e.slug
    assert text.count("no commit known") + text.count("no full commit known") == len(registry) - len(pinned)
    assert text.count("# revisions: draft pinned") == len(pinned)
    assert "/work/" not in text and "shared/reference" not in text  # no path outside the repo


def test_big_targets_carry_tensor_parallel_hints(registry):
    hinted = {e.slug for e in registry if e.tp_hint > 1}
    assert hinted == {"kimi-k2.5", "qwen3.5-122b-a10b", "minimax-m2.5", "qwen3-coder-next", "qwen3.5-397b-a17b",
                      "kimi-k2.6", "minimax-m2.7", "glm-5.1-fp8", "glm-5.3", "kimi-k2.7-code",
                      "glm-5.3-flash"}  # fmt: skip
    for e in registry:  # a parameter count is known, or the entry says it is not
        assert e.target_params_b or "parameter count" in e.notes, e.slug
    assert registry.resolve("minimax-m2.5").shape_from == "MiniMaxAI/MiniMax-M2"
    assert registry.resolve("qwen3.6-27b").draft_gated is True and registry.resolve("qwen3.6-27b").gated
    assert registry.resolve("qwen3.5-9b").mask_token_ids_seen == {"older upload (5 layers)": 248070}


def test_draft_licence_is_the_drafter_cards_and_sourced(registry):
    """`draft.license` is the drafter repo's own (null: not read yet), never copied from the target's, and each
    known one has its public source in docs/families.md."""
    docs = (Path(__file__).parents[1] / "docs" / "families.md").read_text()
    known = {e.slug: e.draft_license for e in registry if e.draft_license is not None}
    assert known == {"qwen3-coder-next": "mit", "qwen3.8-27b": "apache-2.0", "kimi-k2.6": "mit",
                     "glm-5.3": "cc-by-nc-nd-4.0", "kimi-k2.7-code": "nvidia-open-model-license",
                     "laguna-xs-2.1": "openmdw-1.1", "glm-5.3-flash": "cc-by-nc-nd-4.0",
                     "alpamayo-1.5-10b": "nvidia-license"}  # fmt: skip
    for slug in known:
        assert registry.resolve(slug).draft_repo in docs


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("target", {"revision": ""}, "target.revision"),
        ("target", {"tp_hint": 0}, "target.tp_hint"),
        ("target", {"params_b": -3}, "target.params_b"),
        ("draft", {"mask_token_ids_seen": {"old": 999999}}, "mask_token_ids_seen"),
        ("draft", {"license": 3}, "draft.license"),
    ],
)
def test_new_fields_are_validated(tmp_path, field, value, message):
    raw = entry_dict()
    raw[field] = {**raw[field], **value}
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_registry(write_extra(tmp_path, raw))


# ---- architectures, uploads, golden configs -----------------------------------------------------------


def test_architectures_come_from_the_drafter_registry(registry):
    from dflash_zoo.drafters import ARCHS

    assert {e.draft.architecture for e in registry} <= set(ARCHS)
    assert {e.slug for e in registry if e.draft.architecture == "dflash2"} == {
        "qwen3.8-27b", "muse-glimmer-30b", "glm-5.3", "glm-5.3-flash"
    }  # fmt: skip


@pytest.mark.parametrize(
    "draft_over,message",
    [
        ({"architecture": "eagle3"}, r"draft\.architecture.*dflash, dflash2"),
        ({"revisions": []}, r"draft\.revisions.*non-empty"),
        ({"revisions": [{"commit": "abc1234", "num_layers": 5}]}, r"needs a 'label'"),
        ({"revisions": [{"label": "x", "commit": "XYZ", "num_layers": 5}]}, r"7 to 40 lowercase hex"),
        ({"revisions": [{"label": "x"}]}, r"no shape fact"),
        ({"revisions": [{"label": "x", "layers": 5}]}, r"unknown field.*layers"),
        ({"revisions": [{"label": "x", "num_layers": 5}, {"label": "x", "num_layers": 4}]}, r"repeats the label"),
        ({"revisions": [{"label": "x", "num_layers": 6}]}, r"newest upload.*'x'.*num_layers"),
        ({"revisions": [{"label": "x", "num_layers": 5}, {"label": "y", "target_layer_ids": [1, 40]}]},
         r"'y' taps layer 40"),
        ({"revisions": [{"label": "x", "architecture": "dflash3"}]}, r"architecture must be one of"),
    ],
)  # fmt: skip
def test_architecture_and_revisions_are_validated(tmp_path, draft_over, message):
    raw = entry_dict("broken")
    raw["draft"].update(draft_over)
    with pytest.raises(ConfigError, match=rf"'broken'.*{message}"):
        load_registry(write_extra(tmp_path, raw))


def test_an_unknown_architecture_is_null_and_loads(tmp_path):
    raw = entry_dict("foreign")
    raw["draft"]["architecture"] = None
    assert load_registry(write_extra(tmp_path, raw)).resolve("foreign").draft.architecture is None
    del raw["draft"]["architecture"]
    with pytest.raises(ConfigError, match=r"missing field 'draft.architecture' \(null if unknown\)"):
        load_registry(write_extra(tmp_path, raw))


def test_retrained_drafter_lists_both_uploads(registry):
    e = registry.resolve("qwen3.5-122b-a10b")
    assert [(r.label, r.commit, r.num_layers, r.sliding_window) for r in e.revisions] == [
        ("2026-06-19 retrain", "2274357", 6, 4096),
        ("2026-04 original", "6c7242c", 4, 2048),
    ]
    assert e.draft.num_layers == e.revisions[0].num_layers  # the entry's facts are the newest upload's


def _normalised(slug: str, side: str = "draft"):
    from dflash_zoo.engine.config import normalize_draft_config

    return normalize_draft_config(json.loads((FIXTURES / slug / f"{side}.json").read_text()))


@pytest.mark.parametrize("slug", PUBLISHED)
def test_registry_facts_match_the_golden_configs(registry, slug):
    """Every entry's target fingerprint equals its golden target.json; every known drafter fact equals its
    golden draft.json, or (a re-uploaded drafter) one of its listed uploads does."""
    from dflash_zoo.adapters import find_adapter
    from dflash_zoo.adapters.base import TargetAdapter

    from dflash_zoo.zoo.check_sources import fingerprint
    from dflash_zoo.zoo.revisions import identify

    e = registry.resolve(slug)
    if not e.target.known:  # the target's shape is not public: no golden config could hold it
        assert not (FIXTURES / slug).exists() and e.status == "unsupported-here", slug
        return
    target = json.loads((FIXTURES / slug / "target.json").read_text())
    assert fingerprint(target, find_adapter(target["model_type"]) or TargetAdapter) == e.target
    if not (FIXTURES / slug / "draft.json").is_file():  # drafter config not public: nothing known to compare
        assert None in (e.draft.block_size, e.draft.target_layer_ids, e.draft.num_layers), slug
        return
    d = _normalised(slug)
    got = {"block_size": d.block_size, "target_layer_ids": d.target_layer_ids, "architecture": d.arch,
           "mask_token_id": d.mask_token_id, "num_layers": d.num_hidden_layers}  # fmt: skip
    known = {k: v for k, v in vars(e.draft).items() if v is not None}
    if all(got[k] == v for k, v in known.items()):
        return
    assert e.revisions and identify(e.revisions, d).matches, (slug, got, known)  # an older, listed upload


def test_uploads_are_told_apart():
    """`identify` names the upload a config is, and what differs when it is none of them."""
    import dataclasses

    from dflash_zoo.zoo.revisions import identify

    e = load_registry().resolve("qwen3.5-122b-a10b")
    new = _normalised("qwen3.5-122b-a10b")
    found = identify(e.revisions, new)
    assert [r.label for r in found.matches] == ["2026-06-19 retrain"]
    assert found.message() == "your cached copy is the 2026-06-19 retrain upload (commit 2274357)"
    old = dataclasses.replace(new, num_hidden_layers=4, sliding_window=2048)
    assert (
        identify(e.revisions, old).message()
        == "your cached copy is the 2026-04 original upload (commit 6c7242c)"
    )
    odd = identify(e.revisions, dataclasses.replace(new, num_hidden_layers=5))
    assert not odd.matches and odd.message().startswith(
        "matches none of the known uploads: 2026-06-19 retrain:"
    )
    assert "num_layers 5 vs 6" in odd.message() and "num_layers 5 vs 4" in odd.message()
    older = identify(load_registry().resolve("qwen3.5-9b").revisions, _normalised("qwen3.5-9b"))
    assert older.message() == "your cached copy is the 5-layer upload (commit not public)"
