# Summarises the output of benches/wrk/compare.sh: per proxy, the medians of req/s and CPU µs
# per request, then the router's ratios to nginx, to HAProxy and to the earlier binary (when
# they were measured) within each round, as medians over the rounds with their range.
#
#   benches/wrk/compare.sh 9 32 target/release/custom-router > run.txt
#   python3 benches/wrk/ratios.py run.txt [more runs...]
import re
import statistics
import sys

LINE = re.compile(r"([\w-]+) rps=([\d.]+) cpu_us_per_req=([\d.]+)")


def rounds(path):
    rows = [m.groups() for m in map(LINE.match, open(path)) if m]
    names = []
    for name, _, _ in rows:
        if name in names:
            break
        names.append(name)
    size = len(names)
    return [
        {name: (float(rps), float(cpu)) for name, rps, cpu in rows[i : i + size]}
        for i in range(0, len(rows) - size + 1, size)
    ]


def main():
    every = [r for path in sys.argv[1:] for r in rounds(path)]
    names = list(dict.fromkeys(name for r in every for name in r))
    for name in names:
        rps = statistics.median(r[name][0] for r in every if name in r)
        cpu = statistics.median(r[name][1] for r in every if name in r)
        print(f"{name:10} req/s {rps:9.0f}  CPU µs/req {cpu:5.1f}")
    compared = {"nginx": ["rr", "qll", "rr-before", "haproxy"], "haproxy": ["rr", "qll"], "rr-before": ["rr"]}
    for base, others in compared.items():
        for name in others:
            if base not in names or name not in names:
                continue
            both = [r for r in every if name in r and base in r]
            rps = [r[name][0] / r[base][0] for r in both]
            cpu = [r[name][1] / r[base][1] for r in both]
            print(
                f"{name} / {base}: req/s {statistics.median(rps):.3f} ({min(rps):.2f}-{max(rps):.2f}),"
                f" CPU per request {statistics.median(cpu):.3f} ({min(cpu):.2f}-{max(cpu):.2f}),"
                f" {len(rps)} rounds"
            )


main()
