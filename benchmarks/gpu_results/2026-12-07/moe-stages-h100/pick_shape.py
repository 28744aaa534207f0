"""Write moe_ab64's winners into MM_LARGE: for gate_up and down_rows each, the variant whose median graph replay
beats base's median by 8 us or more (kernel error under 1e-2), else the entry stays."""

import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, ".")
from importlib import util  # noqa: E402

spec = util.spec_from_file_location("ab", ".gpu/moe_ab64.py")
rows = json.loads(Path(sys.argv[1]).read_text())
src_path = Path(sys.argv[2])
med = {}
for r in rows:
    med.setdefault(r["variant"], []).append(r)
stats = {k: (statistics.median(x["replay_us"] for x in v), max(x["rel_err"] for x in v)) for k, v in med.items()}
base = stats["base"][0]
print(f"base median replay {base:.1f} us over {len(med['base'])} runs")
for k, (m, e) in sorted(stats.items(), key=lambda kv: kv[1][0]):
    print(f"  {k:24s} {m:8.1f} us ({m - base:+.1f}), err {e:.1e}, runs {len(med[k])}")
text = src_path.read_text()
for prefix, kernel in (("gu ", "gate_up"), ("dn ", "down_rows")):
    cands = [(m, k) for k, (m, e) in stats.items() if k.startswith(prefix) and e < 1e-2 and m <= base - 8]
    if not cands:
        print(f"{kernel}: stays")
        continue
    m, k = min(cands)
    shape = next(r for r in rows if r["variant"] == k)
    ab = util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    cfg = ab.VARIANTS[k][kernel]
    lit = "dict(" + ", ".join(f"{a}={b}" for a, b in cfg.items()) + ")"
    pat = re.compile(r'(    "' + kernel + r'": \(\d+, )dict\([^)]*\)(\),)')
    assert len(pat.findall(text)) == 1, kernel
    text = pat.sub(lambda mo: mo.group(1) + lit + mo.group(2), text)
    print(f"{kernel}: {k} ({m - base:+.1f} us) -> {lit}")
src_path.write_text(text)
