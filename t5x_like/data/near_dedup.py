"""Near-duplicate removal: MinHash signatures of word shingles (in the workers) and an LSH index over them
(datasketch), walked in input order so that the first of each group of near-duplicates is kept."""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

from datasketch import MinHash
from datasketch import MinHashLSH
import numpy as np

_WORD = re.compile(r"\w+", re.U)
SCHEME = "affine32"  # datasketch 2's MinHash permutation scheme, named so signatures mean one thing


@dataclasses.dataclass(frozen=True)
class NearDedupConfig:
  """MinHash LSH settings: a document whose estimated Jaccard similarity (of word shingles) to an earlier
  kept document is at least `threshold` is dropped (dropped_near_duplicate)."""
  enabled: bool = False
  threshold: float = 0.8   # estimated Jaccard similarity at which a document counts as a near-duplicate
  shingle_size: int = 5    # words per shingle (lower-cased \w+ words)
  num_perm: int = 128      # MinHash permutations: the signature length and the estimate's precision
  seed: int = 1            # MinHash permutation seed

  def __post_init__(self):
    if not 0 < self.threshold < 1:
      raise ValueError(f"near-duplicate threshold must be in (0, 1), got {self.threshold}")
    if self.shingle_size < 1 or self.num_perm < 16:
      raise ValueError(f"near-duplicate shingle_size must be >= 1 and num_perm >= 16, got "
                       f"{self.shingle_size}, {self.num_perm}")


def shingles(text: str, size: int) -> set[bytes]:
  """The set of `size`-word shingles of a document (one shingle of all its words when it has fewer)."""
  words = [w.lower() for w in _WORD.findall(text)]
  if len(words) <= size:
    return {" ".join(words).encode("utf-8")}
  return {" ".join(words[i:i + size]).encode("utf-8") for i in range(len(words) - size + 1)}


def signature(text: str, config: NearDedupConfig) -> np.ndarray:
  """uint64 (num_perm,): the MinHash of the document's shingles."""
  m = MinHash(num_perm=config.num_perm, seed=config.seed, scheme=SCHEME)
  m.update_batch(sorted(shingles(text, config.shingle_size)))
  return m.hashvalues.astype(np.uint64)


def signatures(texts: Sequence[str], config: NearDedupConfig) -> np.ndarray:
  """uint64 (len(texts), num_perm)."""
  out = np.zeros([len(texts), config.num_perm], np.uint64)
  for i, text in enumerate(texts):
    out[i] = signature(text, config)
  return out


def find_near_duplicates(sigs: np.ndarray, config: NearDedupConfig) -> dict[int, int]:
  """{dropped document: the earlier kept document it nearly duplicates}, walking `sigs` (n, num_perm) in
  order: a document is kept and indexed unless an indexed one is at least `threshold` similar.

  Order decides which copy survives, so runners pass documents in input order and get the same answer.
  """
  lsh = MinHashLSH(threshold=config.threshold, num_perm=config.num_perm)
  dropped = {}
  for i, sig in enumerate(sigs):
    m = MinHash(num_perm=config.num_perm, seed=config.seed, hashvalues=sig, scheme=SCHEME)
    match = [j for j in sorted(lsh.query(m)) if similar(sigs[j], sig, config)]
    if match:
      dropped[i] = match[0]
    else:
      lsh.insert(i, m, check_duplication=False)
  return dropped


def bands(config: NearDedupConfig) -> list[tuple[int, int]]:
  """The signature slices the LSH index buckets by (datasketch's choice for threshold and num_perm): two
  documents are candidates when any slice is equal."""
  return list(MinHashLSH(threshold=config.threshold, num_perm=config.num_perm).hashranges)


def similar(a: np.ndarray, b: np.ndarray, config: NearDedupConfig) -> bool:
  return float(np.mean(a == b)) >= config.threshold


def walk_similar_pairs(pairs) -> list:
  """`find_near_duplicates`' walk from the candidate pairs alone: (earlier, later) keys of documents that share
  an LSH band and are `similar`. A document is dropped when an earlier one it is similar to was kept; the same
  answer as the walk over every signature, for a runner that finds the pairs in parallel (the Beam runner)."""
  earlier = {}
  for a, b in pairs:
    earlier.setdefault(b, set()).add(a)
  dropped = set()
  for d in sorted(earlier):
    if any(e not in dropped for e in earlier[d]):
      dropped.add(d)
  return sorted(dropped)


def select_documents(scans, exact: bool, config: NearDedupConfig, note) -> tuple[list[np.ndarray], dict]:
  """Which documents of each input survive de-duplication, in input order: exact duplicates (same content
  hash) after the first when `exact`, then near-duplicates of an earlier kept document when `config.enabled`.

  Args:
    scans: per input, an object with `texts`, `hashes` (n, 16) and `signatures` (n, num_perm) or None.
    note: (rule, text) -> None, called for each near-duplicate dropped (the report's examples).

  Returns:
    (a bool mask per input, {"dropped_duplicate": n, "dropped_near_duplicate": m}).
  """
  keep = [np.ones(len(s.texts), bool) for s in scans]
  seen, dropped_exact = set(), 0
  for s, mask in zip(scans, keep):
    for j, h in enumerate(s.hashes):
      h = h.tobytes()
      if exact and h in seen:
        mask[j] = False
        dropped_exact += 1
      seen.add(h)
  counts = {"dropped_duplicate": dropped_exact, "dropped_near_duplicate": 0}
  if not config.enabled:
    return keep, counts
  where = [(i, j) for i, mask in enumerate(keep) for j in np.flatnonzero(mask)]
  sigs = np.stack([scans[i].signatures[j] for i, j in where]) if where else np.zeros([0, config.num_perm], np.uint64)
  for k in sorted(find_near_duplicates(sigs, config)):
    i, j = where[k]
    keep[i][j] = False
    counts["dropped_near_duplicate"] += 1
    note("near_duplicate", scans[i].texts[j])
  return keep, counts
