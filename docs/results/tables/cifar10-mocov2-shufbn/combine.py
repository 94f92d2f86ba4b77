"""Combine the committed MoCo v2 table (MoCo rows with plain batch norm) and the shuffled-BN re-run into one table.

python combine.py OLD/table.json NEW/table.json combined.json
"""

import copy
import json
import sys

old = json.load(open(sys.argv[1]))
new = json.load(open(sys.argv[2]))
out = copy.deepcopy(old)
for row in old["rows"]:
    if row["slug"].startswith("moco"):
        row_old = next(r for r in out["rows"] if r["slug"] == row["slug"])
        row_old["label"] = row["label"] + ", plain BN"
        row_old["slug"] = row["slug"] + "_plainbn"
        for r in row_old["runs"]:
            r["label"], r["slug"] = row_old["label"], row_old["slug"]
for row in new["rows"]:
    if not row.get("runs"):
        continue
    r2 = copy.deepcopy(row)
    r2["label"] = row["label"] + ", shuffled BN"
    r2["slug"] = row["slug"] + "_shufbn"
    for r in r2["runs"]:
        r["label"], r["slug"] = r2["label"], r2["slug"]
    out["rows"].append(r2)
out["title"] = old["title"] + " (MoCo rows with plain and with shuffled batch norm)"
json.dump(out, open(sys.argv[3], "w"), indent=1)
print([(r["label"], len(r["runs"])) for r in out["rows"]])
