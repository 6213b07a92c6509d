"""Write the files the "your own data" examples read, as a user would bring them, from the data
the package ships (raylowcomm.assets: Rotten Tomatoes, Amazon review snippets, MNIST, UCI digits).

    python examples/make_example_data.py [--out examples/data]

    reviews/reviews.csv        12,808 Rotten Tomatoes snippets; columns review, verdict (fresh / rotten)
    reviews/amazon.csv         2,985 Amazon snippets, the shift set; columns snippet, opinion (same names)
    digits/{train,test}/<name>/*.png    MNIST digits as PNG class folders named zero .. nine
    uci_digits/<name>/*.png    UCI optical digits (8x8), the shift set, the same class folders
    nodes/node_0/reviews.csv   node-local training files: node 0's 2,000 reviews ...
    nodes/node_1/reviews.csv   ... and node 1's 3,000 (other rows: the nodes share none)
    nodes/eval.csv             1,000 other reviews the driver scores on

Then: raylowcomm run examples/own_data_csv.yaml (or own_data_imagefolder.yaml, node_local.yaml).
Nothing here is needed by the package; delete the folder when done.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from PIL import Image

from raylowcomm import assets

VERDICT = {"1": "fresh", "0": "rotten"}
DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def read(asset: str) -> list[dict]:
    with open(assets.require(asset), newline="") as f:
        return list(csv.DictReader(f))


def write(path: Path, header: list[str], rows) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        n = 0
        for row in rows:
            writer.writerow(row)
            n += 1
    return n


def pngs(rows: list[dict], folder_of) -> int:
    """One PNG per digit row (label, space-separated grey pixels of a square image)."""
    for i, row in enumerate(rows):
        folder = folder_of(i, int(row["label"]))
        if folder is None:
            continue
        pixels = np.array(row["pixels"].split(), dtype=np.uint8)
        side = int(round(len(pixels) ** 0.5))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.reshape(side, side)).save(folder / f"{i:05d}.png")
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(Path(__file__).resolve().parent / "data"), help="where to write (default: examples/data)"
    )
    parser.add_argument(
        "--train-per-class", type=int, default=200, help="MNIST training PNGs per class (of 500; default 200)"
    )
    parser.add_argument("--test-per-class", type=int, default=50, help="MNIST test PNGs per class (default 50)")
    args = parser.parse_args(argv)
    out = Path(args.out)

    # A CSV whose columns are not called text / label and whose labels are words.
    reviews = read("rotten_tomatoes")
    n = write(
        out / "reviews" / "reviews.csv", ["review", "verdict"], ([r["text"], VERDICT[r["label"]]] for r in reviews)
    )
    print(f"{out / 'reviews' / 'reviews.csv'}: {n} rows")
    # Its shift set: other column names, other column order, the same label names.
    n = write(
        out / "reviews" / "amazon.csv",
        ["opinion", "snippet"],
        ([VERDICT[r["label"]], r["text"]] for r in read("amazon_reviews")),
    )
    print(f"{out / 'reviews' / 'amazon.csv'}: {n} rows")

    # Node-local training files (disjoint rows, of different sizes) and the driver's evaluation file.
    for k, (lo, hi) in enumerate([(0, 2000), (2000, 5000)]):
        path = out / "nodes" / f"node_{k}" / "reviews.csv"
        n = write(path, ["review", "verdict"], ([r["text"], VERDICT[r["label"]]] for r in reviews[lo:hi]))
        print(f"{path}: {n} rows")
    n = write(
        out / "nodes" / "eval.csv",
        ["review", "verdict"],
        ([r["text"], VERDICT[r["label"]]] for r in reviews[10000:11000]),
    )
    print(f"{out / 'nodes' / 'eval.csv'}: {n} rows")

    # PNG class folders: train/ and test/ splits of MNIST, the UCI digits as a shift folder.
    seen = [0] * 10
    total = args.train_per_class + args.test_per_class

    def mnist_folder(i: int, label: int) -> Path | None:
        k, seen[label] = seen[label], seen[label] + 1
        if k >= total:
            return None
        return out / "digits" / ("train" if k < args.train_per_class else "test") / DIGITS[label]

    pngs(read("mnist"), mnist_folder)
    print(f"{out / 'digits'}: {10 * args.train_per_class} train + {10 * args.test_per_class} test PNGs")
    n = pngs(read("uci_digits"), lambda i, label: out / "uci_digits" / DIGITS[label])
    print(f"{out / 'uci_digits'}: {n} PNGs")


if __name__ == "__main__":
    main()
