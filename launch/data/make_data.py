"""Regenerate the small shipped data sets (deterministic; text written for memkit, no licence
strings attached):

    python launch/data/make_data.py

text.jsonl: 240 short descriptive sentences ({"text": ...}), for quick fine-tuning checks.
qa.jsonl:   240 arithmetic prompt/completion pairs ({"prompt": ..., "completion": ...}); the
            loss is taken on the completion only.
"""
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
ANIMALS = ["fox", "owl", "cat", "horse", "otter", "heron", "badger", "goat"]
COLOURS = ["red", "grey", "black", "white", "brown", "golden"]
PLACES = ["river", "forest", "meadow", "hill", "barn", "harbour"]
ACTIONS = ["sleeps near the", "runs across the", "waits beside the", "walks along the", "hides in the"]
TIMES = ["at dawn", "at noon", "in the evening", "after the rain", "before winter"]


def text_records(rng: random.Random) -> list[dict]:
    out = []
    for _ in range(240):
        a, c, p = rng.choice(ANIMALS), rng.choice(COLOURS), rng.choice(PLACES)
        sentence = f"The {c} {a} {rng.choice(ACTIONS)} {p} {rng.choice(TIMES)}."
        if rng.random() < 0.5:
            sentence += f" Every day the {a} returns to the {p}."
        out.append({"text": sentence})
    return out


def qa_records(rng: random.Random) -> list[dict]:
    out = []
    for _ in range(240):
        x, y = rng.randint(0, 49), rng.randint(0, 49)
        if rng.random() < 0.5:
            out.append({"prompt": f"Q: What is {x} plus {y}?\nA:", "completion": f" {x + y}"})
        else:
            hi, lo = max(x, y), min(x, y)
            out.append({"prompt": f"Q: What is {hi} minus {lo}?\nA:", "completion": f" {hi - lo}"})
    return out


def main() -> None:
    for name, make in (("text.jsonl", text_records), ("qa.jsonl", qa_records)):
        rng = random.Random(name)
        with open(HERE / name, "w") as handle:
            for record in make(rng):
                handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
