"""Write the best merge/mix step shape of mix_steps.json into hyper.py's DECODE_MIX when a tree-kernel ("hs") shape's
median replay beats base's by 8 us or more; prints what it did."""

import json
import re
import statistics
import sys
from pathlib import Path

steps = json.loads(Path(sys.argv[1]).read_text()) if Path(sys.argv[1]).exists() else []
by: dict[str, list[float]] = {}
for r in steps:
    by.setdefault(r["shape"], []).append(r["replay_us"])
med = {k: statistics.median(v) for k, v in by.items()}
print("median replay us:", json.dumps(med))
base = med.get("base")
cands = sorted((v, k) for k, v in med.items() if k.startswith("hs-"))
if base is None or not cands or cands[0][0] > base - 8:
    print("keeping the tree's DECODE_MIX")
    sys.exit(0)
_, block, rows, warps = cands[0][1].split("-")
path = Path(sys.argv[2])
src = path.read_text()
new = re.sub(r"^DECODE_MIX = \(\d+, \d+, \d+\)", f"DECODE_MIX = ({block}, {rows}, {warps})", src, count=1, flags=re.M)
path.write_text(new)
print(f"DECODE_MIX = ({block}, {rows}, {warps}): {cands[0][0]:.1f} us against base {base:.1f}")
