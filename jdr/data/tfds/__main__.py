"""python -m jdr.data.tfds SOURCE_DIR DATA_DIR --name NAME: prepare jdr_pairs/NAME (+ jdr_corpus/NAME).

The builders live in jdr.data.tfds.builders, not here: TFDS needs a builder in an importable module.
"""

from jdr.runtime import host_memory

# `python -m` this module: glibc's malloc on huge pages, by re-executing before anything heavy is imported.
host_memory.reexec_if_command(__name__)

import argparse

from jdr.data import tfds as jdr_tfds


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jdr.data.tfds", description=__doc__.splitlines()[0])
  parser.add_argument("source_dir", help="local BEIR or MS MARCO directory (the TFDS manual_dir)")
  parser.add_argument("data_dir", help="TFDS data directory to write array_record files under")
  parser.add_argument("--name", required=True, help="dataset name, e.g. scifact (the TFDS config name)")
  parser.add_argument("--no-corpus", action="store_true", help="skip the jdr_corpus dataset")
  parser.add_argument("--skip-invalid", action="store_true", help="drop malformed records (counted) instead of failing")
  args = parser.parse_args(argv)
  builder = jdr_tfds.prepare(args.source_dir, args.data_dir, name=args.name, corpus=not args.no_corpus,
                             skip_invalid=args.skip_invalid)
  for split, info in builder.info.splits.items():
    print(f"{builder.name}/{args.name} {split}: {info.num_examples} examples")
  print(f"data: {builder.data_path}")


if __name__ == "__main__":
  main()
