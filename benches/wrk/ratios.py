# Summarises the output of benches/wrk/compare.sh: per proxy, the medians of req/s, CPU µs
# per request and wrk's p50 and p99 latency, then the router's ratios to nginx, to HAProxy and
# to the earlier binary (when they were measured) within each round, as medians over the rounds
# with their range; with TWO_WORKERS=1 also the two-worker peers against each other and the
# router's two threads against its one.
#
#   benches/wrk/compare.sh 9 32 target/release/custom-router > run.txt
#   python3 benches/wrk/ratios.py run.txt [more runs...]
import re
import statistics
import sys

LINE = re.compile(r"([\w-]+) rps=([\d.]+) cpu_us_per_req=([\d.]+)(?: p50=(\S+) p99=(\S+))?")
UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6}


def micros(text):
    """wrk's latency (61.00us, 1.23ms, 1.01s) in µs; None if absent."""
    match = re.fullmatch(r"([\d.]+)(us|ms|s)", text or "")
    return float(match[1]) * UNITS[match[2]] if match else None


def rounds(path):
    rows = [m.groups() for m in map(LINE.match, open(path)) if m]
    names = []
    for name, *_ in rows:
        if name in names:
            break
        names.append(name)
    size = len(names)
    return [
        {
            name: (float(rps), float(cpu), micros(p50), micros(p99))
            for name, rps, cpu, p50, p99 in rows[i : i + size]
        }
        for i in range(0, len(rows) - size + 1, size)
    ]


def main():
    every = [r for path in sys.argv[1:] for r in rounds(path)]
    names = list(dict.fromkeys(name for r in every for name in r))
    for name in names:
        rps = statistics.median(r[name][0] for r in every if name in r)
        cpu = statistics.median(r[name][1] for r in every if name in r)
        latency = ""
        for label, index in (("p50", 2), ("p99", 3)):
            values = [r[name][index] for r in every if name in r and r[name][index] is not None]
            if values:
                latency += f"  {label} µs {statistics.median(values):7.1f}"
        print(f"{name:10} req/s {rps:9.0f}  CPU µs/req {cpu:5.1f}{latency}")
    compared = [
        ("nginx", ["rr", "qll", "rr-before", "haproxy"]),
        ("haproxy", ["rr", "qll"]),
        ("rr-before", ["rr"]),
        ("nginx-2", ["rr-2", "haproxy-2"]),
        ("haproxy-2", ["rr-2"]),
        ("rr", ["rr-2"]),
        ("nginx", ["nginx-2"]),
        ("haproxy", ["haproxy-2"]),
    ]
    for base, others in compared:
        for name in others:
            if base not in names or name not in names:
                continue
            # A measurement with no requests (a peer that failed) has no ratio.
            both = [
                r
                for r in every
                if name in r and base in r and r[name][0] >= 1 and r[base][0] >= 1 and r[base][1]
            ]
            if not both:
                continue
            rps = [r[name][0] / r[base][0] for r in both]
            cpu = [r[name][1] / r[base][1] for r in both]
            print(
                f"{name} / {base}: req/s {statistics.median(rps):.3f} ({min(rps):.2f}-{max(rps):.2f}),"
                f" CPU per request {statistics.median(cpu):.3f} ({min(cpu):.2f}-{max(cpu):.2f}),"
                f" {len(rps)} rounds"
            )


main()
