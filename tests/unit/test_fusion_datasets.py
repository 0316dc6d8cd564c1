"""The vision dataset generator (seeded, balanced, with splits and prompts) and folder datasets."""
from __future__ import annotations

import csv

import pytest

from vlora.fusion.datasets import (
    IMAGE_PLACEHOLDER,
    LABELS_FILE,
    SPLITS,
    TASKS,
    generate,
    load_folder,
    resolve_dataset,
    save_folder,
)

SMALL = {"train": 12, "val": 6, "test": 6}


def _pixels(ds):
    return [[img.tobytes() for img in s.images] for split in SPLITS for s in ds.split(split)]


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generated_dataset_is_reproducible_balanced_and_prompted(task):
    ds = generate(task, seed=3, sizes=SMALL)
    again = generate(task, seed=3, sizes=SMALL)
    other = generate(task, seed=4, sizes=SMALL)
    assert _pixels(ds) == _pixels(again)
    assert _pixels(ds) != _pixels(other)
    assert [len(ds.split(s)) for s in SPLITS] == [12, 6, 6]
    counts = {}
    for s in ds.split("train"):
        counts[s.label] = counts.get(s.label, 0) + 1
        assert all(img.size == (64, 64) and img.mode == "RGB" for img in s.images)
    assert set(counts) <= set(ds.labels) and max(counts.values()) - min(counts.values()) <= 1
    sample = ds.split("test")[0]
    prompt = ds.prompt_for(len(sample.images))
    assert prompt.count(IMAGE_PLACEHOLDER) == len(sample.images)
    assert prompt.startswith("USER: ") and prompt.endswith("ASSISTANT:")
    # Splits do not repeat each other's images.
    train = {tuple(p) for p in ([img.tobytes() for img in s.images] for s in ds.split("train"))}
    assert not any(tuple(img.tobytes() for img in s.images) in train for s in ds.split("test"))


def test_action_has_four_to_eight_frames_and_moves():
    ds = generate("action", seed=0, sizes={"train": 40, "val": 0, "test": 0})
    lengths = {len(s.images) for s in ds.split("train")}
    assert min(lengths) >= 4 and max(lengths) <= 8 and len(lengths) > 1
    short = generate("action", seed=0, sizes={"train": 10, "val": 0, "test": 0}, min_frames=4, max_frames=4)
    assert {len(s.images) for s in short.split("train")} == {4}
    for s in ds.split("train"):
        assert s.images[0].tobytes() != s.images[-1].tobytes()


def test_counting_draws_the_labelled_number_of_circles():
    """More circles (distractors are 0 to 3 of any count) mean more coloured pixels on average."""
    ds = generate("count-circles", seed=1, sizes={"train": 60, "val": 0, "test": 0})

    def coloured(img):
        px = img.load()
        return sum(1 for x in range(img.width) for y in range(img.height) if max(px[x, y]) - min(px[x, y]) > 60)

    by_label = {}
    for s in ds.split("train"):
        by_label.setdefault(int(s.label), []).append(coloured(s.images[0]))
    means = [sum(v) / len(v) for _, v in sorted(by_label.items())]
    assert means[-1] > means[0] * 2


def test_folder_round_trip(tmp_path):
    ds = generate("action", seed=2, sizes=SMALL, min_frames=4, max_frames=5)
    save_folder(ds, tmp_path / "ds")
    back = load_folder(tmp_path / "ds")
    assert (back.name, back.task_type, back.labels, back.prompt) == (ds.name, ds.task_type, ds.labels, ds.prompt)
    for split in SPLITS:
        assert [s.label for s in back.split(split)] == [s.label for s in ds.split(split)]
        assert [[i.tobytes() for i in s.images] for s in back.split(split)] == \
               [[i.tobytes() for i in s.images] for s in ds.split(split)]
    assert resolve_dataset(str(tmp_path / "ds")).name == "action"


def test_plain_folder_without_splits_or_metadata(tmp_path):
    from PIL import Image

    rows = []
    for i in range(20):
        Image.new("RGB", (40, 30), (i * 10, 0, 0)).save(tmp_path / f"{i}.png")
        rows.append({"images": f"{i}.png", "label": "cat" if i % 2 else "dog"})
    with open(tmp_path / LABELS_FILE, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["images", "label"])
        w.writeheader()
        w.writerows(rows)
    ds = load_folder(tmp_path)
    assert ds.labels == ("cat", "dog") and ds.task_type == "classification" and ds.name == tmp_path.name
    assert [len(ds.split(s)) for s in SPLITS] == [16, 2, 2]
    assert "{images}" in ds.prompt and "cat, dog" in ds.prompt


@pytest.mark.parametrize("row,message", [
    ({"images": "../outside.png", "label": "a"}, "not a file inside"),
    ({"images": "missing.png", "label": "a"}, "not a file inside"),
    ({"images": "ok.png", "label": ""}, "empty label"),
    ({"images": "ok.png", "label": "a", "split": "holdout"}, "split 'holdout'"),
    ({"images": "", "label": "a"}, "no image"),
])
def test_bad_folder_rows_are_refused(tmp_path, row, message):
    from PIL import Image

    d = tmp_path / "ds"
    d.mkdir()
    Image.new("RGB", (40, 40)).save(d / "ok.png")
    Image.new("RGB", (40, 40)).save(tmp_path / "outside.png")
    with open(d / LABELS_FILE, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["images", "label", "split"])
        w.writeheader()
        w.writerow({"images": "ok.png", "label": "b", "split": "train"})
        w.writerow({"split": "", **row})
    with pytest.raises(ValueError, match=message):
        load_folder(d)


def test_unknown_dataset_is_named():
    with pytest.raises(ValueError, match="neither a generated task"):
        resolve_dataset("count-unicorns")
