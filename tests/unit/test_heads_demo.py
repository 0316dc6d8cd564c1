"""The trained demo adapters: committed for the current tiny model, loadable with their heads, better
than chance, and copied (never trained) into the demo adapter root."""
from __future__ import annotations

import json
import logging
import shutil

from vlora.fusion.demo import TRAINED_DEMOS, _stamp, example_request
from vlora.lora.adapter import decoder_module_dims, load_adapter
from vlora.lora.demo import COMMITTED_DIR, STAMP_FILE, install_committed_demos, model_fingerprint


def test_committed_demo_adapters_match_the_tiny_model(tiny_model_dir):
    fingerprint = model_fingerprint(tiny_model_dir)
    for spec in TRAINED_DEMOS:
        stamp = json.loads((COMMITTED_DIR / spec.name / STAMP_FILE).read_text())
        assert stamp == _stamp(spec, fingerprint), (
            f"{spec.name} was trained for another tiny model or spec: retrain the committed copies with "
            f"`python -m vlora.fusion.demo --write-committed`")


def test_demo_adapters_load_with_heads_that_beat_chance(tiny_model_dir, tmp_path):
    present = install_committed_demos(tiny_model_dir, tmp_path)
    assert present == [s.name for s in TRAINED_DEMOS]
    assert sorted(p.name for p in COMMITTED_DIR.iterdir()) == sorted(present)  # nothing committed that no spec makes
    text = json.loads((tiny_model_dir / "config.json").read_text())["text_config"]
    for spec in TRAINED_DEMOS:
        w = load_adapter(tmp_path, spec.name, num_layers=text["num_hidden_layers"], module_dims=decoder_module_dims(text),
                         max_rank=64, supported_modules=("q_proj", "v_proj"))
        assert sorted(w.heads) == sorted(spec.tasks)
        acc = json.loads((tmp_path / spec.name / "vlora_demo_accuracy.json").read_text())
        for task in spec.tasks:
            assert acc["test_accuracy"][task] > acc["chance"][task] + 0.08, (task, acc)


def test_demo_adapters_of_another_model_are_left_out_not_trained(tiny_model_dir, tmp_path, caplog):
    """Serving never trains: a model the committed demos were not trained on gets none of them, with a warning
    that names the command that retrains them."""
    other = tmp_path / "model"
    shutil.copytree(tiny_model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] += 1
    (other / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="vlora.lora.demo"):
        present = install_committed_demos(other, tmp_path / "adapters")
    assert present == [] and not (tmp_path / "adapters").exists()
    assert "--write-committed" in caplog.text and all(s.name in caplog.text for s in TRAINED_DEMOS)


def test_example_request_is_a_head_request():
    text = example_request("color", seed=2)
    body = json.loads(text.split("-d '", 1)[1].rsplit("'", 1)[0])
    params = json.loads(body["sampling_parameters"])
    assert params == {"lora_name": "demo-shapes", "task": "color"} and len(body["image"]) == 1
    assert body["text_input"].count("<image>") == 1


def test_fingerprint_ignores_the_transformers_version_in_the_config(tiny_model_dir, tmp_path):
    """save_pretrained writes the installed transformers version into config.json: a release that generates
    the same tiny model bit for bit must leave the fingerprint (and the committed demos) as they are."""
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.1-other"
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    assert model_fingerprint(copy) == model_fingerprint(tiny_model_dir)
    config["text_config"]["num_hidden_layers"] += 1  # any other change of the config still counts
    (copy / "config.json").write_text(json.dumps(config, indent=2))
    assert model_fingerprint(copy) != model_fingerprint(tiny_model_dir)
