import re, sys, collections
for fn in sys.argv[1:]:
    lines = [l for l in open(fn) if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
    ins = []
    for l in lines:
        a = int(re.match(r"\s+/\*([0-9a-f]+)\*/", l).group(1), 16)
        body = re.sub(r"/\*.*?\*/", "", l).strip().rstrip(";").strip()
        ins.append((a, body))
    for a, b in ins:
        mm = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", b)
        t = re.search(r"BRA.*?0x([0-9a-f]+)", b)
        if "BRA" in b and t:
            tgt = int(t.group(1), 16)
            if tgt < a and a - tgt > 0x400:
                body = [x for aa, x in ins if tgt <= aa <= a]
                c = collections.Counter(x.split()[0].split(".")[0] if not x.startswith("@") else x.split()[1].split(".")[0] for x in body)
                print(fn, hex(tgt), hex(a), len(body), dict(c.most_common(14)))
