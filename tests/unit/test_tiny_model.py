"""The embedded tiny model, the LLaVA loader (tiny and llava-hf layouts) and prompt building."""
from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from vlora.engine.api import InvalidRequest
from vlora.models.loader import LLAVA_15_CHAT_TEMPLATE, ModelLoadError, build_prompt_ids, load_llava
from vlora.models.tiny import TEXT, VISION, ensure_tiny_model, tiny_model_dirname


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir) -> Path:  # tests/conftest.py generates it once per session
    return tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_llava(tiny_dir, torch.float32, "cpu")


@pytest.fixture(scope="module")
def hf_layout_dir(tiny, tiny_dir, tmp_path_factory) -> Path:
    """A folder laid out like llava-hf/llava-1.5-7b-hf: sharded safetensors with an index, tokenizer
    files with no template, the processor's template in chat_template.json."""
    out = tmp_path_factory.mktemp("llava-hf") / "llava-like"
    tiny.model.save_pretrained(out, max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json"):
        shutil.copy(tiny_dir / name, out / name)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": LLAVA_15_CHAT_TEMPLATE.replace("ASSISTANT:", "ASSISTANT: ")}))
    return out


def test_generation_is_deterministic(tiny_dir, tmp_path):
    again = ensure_tiny_model(tmp_path)
    assert again.name == tiny_dir.name == tiny_model_dirname()
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert _sha(tiny_dir / name) == _sha(again / name), name


def test_generation_is_idempotent_and_leaves_global_rng_alone(tiny_dir):
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    assert ensure_tiny_model(tiny_dir.parent) == tiny_dir
    assert torch.equal(torch.rand(3), expected)
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before


def test_concurrent_generation_gives_one_complete_folder(tmp_path):
    results, errors = [], []

    def run():
        try:
            results.append(ensure_tiny_model(tmp_path))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [results[0].name]  # no temporary folder left
    assert (results[0] / "model.safetensors").is_file()


def test_tiny_model_files_and_readme(tiny_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "preprocessor_config.json", "README.md"):
        assert (tiny_dir / name).is_file(), name
    assert not list(tiny_dir.glob("*.bin"))
    readme = (tiny_dir / "README.md").read_text()
    assert "not a trained one" in readme and "meaningless" in readme


def test_loaded_tiny_model(tiny):
    cfg = tiny.model.config
    assert type(tiny.model).__name__ == "LlavaForConditionalGeneration"
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert tiny.num_image_tokens == (VISION["image_size"] // VISION["patch_size"]) ** 2 == 64
    assert tiny.image_token_id == cfg.image_token_index == tiny.tokenizer.convert_tokens_to_ids("<image>")
    assert tiny.max_model_len == TEXT["max_position_embeddings"]
    tc = tiny.text_config
    assert (tc.hidden_size, tc.num_hidden_layers, tc.num_attention_heads, tc.num_key_value_heads) == (128, 4, 4, 2)
    assert tc.vocab_size == len(tiny.tokenizer)
    assert 900 <= len(tiny.tokenizer) <= 2100
    tok = tiny.tokenizer
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == ("<s>", "</s>", "<unk>", "<pad>")
    assert tiny.name.startswith("tiny-llava-")
    assert next(tiny.model.parameters()).dtype == torch.float32


def test_tiny_model_forward_with_an_image(tiny):
    from PIL import Image

    from vlora.models.images import pixel_values

    ids = build_prompt_ids(tiny, "What is in the image?", 1, apply_chat_template=True)
    pv = pixel_values([Image.new("RGB", (100, 70), (10, 200, 30))], tiny.image_processor)
    assert pv.shape == (1, 3, 64, 64)
    with torch.no_grad():
        logits = tiny.model(input_ids=torch.tensor([ids]), pixel_values=pv).logits
    assert logits.shape == (1, len(ids), len(tiny.tokenizer))
    assert torch.isfinite(logits).all()


def test_llava_hf_layout_loads_by_the_same_path(tiny, hf_layout_dir):
    assert (hf_layout_dir / "model.safetensors.index.json").is_file()
    assert len(list(hf_layout_dir.glob("model-*-of-*.safetensors"))) >= 2
    other = load_llava(hf_layout_dir, torch.float32, "cpu")
    assert other.num_image_tokens == tiny.num_image_tokens
    assert other.chat_template.endswith("ASSISTANT: ' }}{% endif %}")  # from chat_template.json
    ids = torch.tensor([build_prompt_ids(tiny, "hello there", 0, False)])
    with torch.no_grad():
        assert torch.equal(tiny.model(input_ids=ids).logits, other.model(input_ids=ids).logits)


def test_loads_in_bfloat16(tiny_dir):
    loaded = load_llava(tiny_dir, torch.bfloat16, "cpu")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


def test_fallback_chat_template(hf_layout_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(hf_layout_dir, bare)
    (bare / "chat_template.json").unlink()
    loaded = load_llava(bare, torch.float32, "cpu")
    assert loaded.chat_template == LLAVA_15_CHAT_TEMPLATE
    ids = build_prompt_ids(loaded, "Hi", 1, apply_chat_template=True)
    text = loaded.tokenizer.decode([i for i in ids if i != loaded.image_token_id])
    assert text == "<s>USER: \nHi ASSISTANT:"


def test_pickle_weights_are_refused(tiny_dir, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(tiny_dir / "config.json", folder / "config.json")
    torch.save({"x": torch.zeros(1)}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_llava(folder, torch.float32, "cpu")


def test_other_model_types_and_missing_folders_are_refused(tiny_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_llava(tmp_path / "nope", torch.float32, "cpu")
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="model_type 'llama'"):
        load_llava(folder, torch.float32, "cpu")


# ---- prompt building


def _decode_runs(loaded, ids):
    """Show each image's run of image tokens as one '[IMG]' and decode the rest."""
    out, run = [], 0
    for i in ids:
        if i == loaded.image_token_id:
            run += 1
            continue
        if run:
            assert run % loaded.num_image_tokens == 0
            out.append("[IMG]" * (run // loaded.num_image_tokens))
            run = 0
        out.append(loaded.tokenizer.decode([i]))
    assert run % loaded.num_image_tokens == 0
    out.append("[IMG]" * (run // loaded.num_image_tokens))
    return "".join(out)


def test_prompt_text_is_used_as_given(tiny):
    ids = build_prompt_ids(tiny, "What is this?", 0, False)
    assert ids[0] == tiny.tokenizer.bos_token_id and ids.count(tiny.tokenizer.bos_token_id) == 1
    assert _decode_runs(tiny, ids) == "<s>What is this?"


def test_images_come_first_without_placeholders(tiny):
    ids = build_prompt_ids(tiny, "Describe these.", 2, False)
    assert _decode_runs(tiny, ids) == "<s>[IMG][IMG]Describe these."


def test_placeholders_mark_where_images_go(tiny):
    ids = build_prompt_ids(tiny, "First <image> then <image>.", 2, False)
    assert _decode_runs(tiny, ids) == "<s>First [IMG] then [IMG]."
    assert ids.count(tiny.image_token_id) == 2 * tiny.num_image_tokens


def test_placeholder_count_mismatch_names_both_counts(tiny):
    with pytest.raises(InvalidRequest, match=r"2 <image> placeholder\(s\).*1 image\(s\)"):
        build_prompt_ids(tiny, "<image> and <image>", 1, False)
    with pytest.raises(InvalidRequest, match=r"1 <image> placeholder\(s\).*0 image\(s\)"):
        build_prompt_ids(tiny, "<image> alone", 0, True)


def test_chat_template_wraps_the_prompt(tiny):
    ids = build_prompt_ids(tiny, "What is this?", 1, True)
    assert _decode_runs(tiny, ids) == "<s>USER: [IMG]\nWhat is this? ASSISTANT:"
    ids = build_prompt_ids(tiny, "Compare <image> with <image>", 2, True)
    assert _decode_runs(tiny, ids) == "<s>USER: Compare [IMG] with [IMG] ASSISTANT:"


def test_bos_is_not_doubled(tiny):
    ids = build_prompt_ids(tiny, "<s>Hello", 0, False)
    assert ids.count(tiny.tokenizer.bos_token_id) == 1 and ids[0] == tiny.tokenizer.bos_token_id


def test_empty_prompt_is_refused_but_an_image_alone_is_fine(tiny):
    with pytest.raises(InvalidRequest, match="empty prompt"):
        build_prompt_ids(tiny, "", 0, False)
    assert _decode_runs(tiny, build_prompt_ids(tiny, "", 1, False)) == "<s>[IMG]"


def test_prompt_ids_match_transformers_llava_processor(tiny, tiny_dir):
    from PIL import Image
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(tiny_dir), local_files_only=True)
    except ImportError as e:  # transformers 5.17 wants torchvision for it
        pytest.skip(f"LlavaProcessor unavailable: {e}")
    text = "USER: <image>\nWhat is in the picture? ASSISTANT:"
    expected = processor(images=[Image.new("RGB", (80, 80))], text=text, return_tensors="pt")["input_ids"][0].tolist()
    assert build_prompt_ids(tiny, text, 1, False) == expected


def test_pickle_files_beside_safetensors_are_never_read(tiny_dir, tmp_path):
    folder = tmp_path / "both"
    shutil.copytree(tiny_dir, folder)
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle; reading it would fail")
    assert load_llava(folder, torch.float32, "cpu").num_image_tokens == 64
