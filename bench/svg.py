"""Small SVG charts for the benchmark report, written by hand so the suite needs nothing
beyond the Python standard library."""
import math

COLORS = ["#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd"]


def _esc(s):
    return str(s).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _ticks(lo, hi, log):
    if log:
        a, b = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
        return [10 ** e for e in range(a, b + 1)]
    step = 10 ** math.floor(math.log10(max(hi - lo, 1e-9)))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= 6:
            step *= m
            break
    t, out = 0.0, []
    while t <= hi * 1.0001:
        out.append(t)
        t += step
    return out


def _fmt(v):
    if v == 0:
        return "0"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 1:
        return f"{v:g}"
    return f"{v:.3g}"


def bars(title, unit, groups, series, values, log=False, width=640, height=320):
    """Grouped bars: values[series][group] is a number or None (drawn as 'n/a')."""
    left, right, top, bottom = 70, 20, 40, 60
    pw, ph = width - left - right, height - top - bottom
    nums = [v for s in values for v in s if v]
    hi = max(nums) if nums else 1.0
    lo = min(nums) if nums else 1.0
    if log:
        lo, hi = 10 ** math.floor(math.log10(lo)), 10 ** math.ceil(math.log10(hi))
    else:
        lo, hi = 0.0, hi * 1.15
    ticks = _ticks(lo, hi, log)
    hi = max(hi, ticks[-1])

    def y(v):
        if log:
            return top + ph * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))
        return top + ph * (1 - (v - lo) / (hi - lo))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{_esc(title)}</text>',
           f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" text-anchor="middle">{_esc(unit)}</text>']
    for t in ticks:
        if lo <= t <= hi:
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{left - 5}" y="{y(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    gw = pw / max(len(groups), 1)
    bw = gw * 0.8 / max(len(series), 1)
    for gi, g in enumerate(groups):
        out.append(f'<text x="{left + gw * (gi + 0.5):.1f}" y="{top + ph + 16}" text-anchor="middle">{_esc(g)}</text>')
        for si, _ in enumerate(series):
            v = values[si][gi]
            x = left + gw * gi + gw * 0.1 + bw * si
            if v:
                yy = y(v)
                out.append(f'<rect x="{x:.1f}" y="{yy:.1f}" width="{bw:.1f}" height="{top + ph - yy:.1f}" fill="{COLORS[si % 5]}"/>')
                out.append(f'<text x="{x + bw / 2:.1f}" y="{yy - 3:.1f}" text-anchor="middle" font-size="9">{_fmt(v)}</text>')
            else:
                out.append(f'<text x="{x + bw / 2:.1f}" y="{top + ph - 4}" text-anchor="middle" font-size="9">n/a</text>')
    for si, s in enumerate(series):
        lx = left + si * 160
        out.append(f'<rect x="{lx}" y="{height - 22}" width="10" height="10" fill="{COLORS[si % 5]}"/>')
        out.append(f'<text x="{lx + 14}" y="{height - 13}">{_esc(s)}</text>')
    out.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{top + ph}" stroke="black"/>')
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{top + ph}" y2="{top + ph}" stroke="black"/>')
    out.append("</svg>")
    return "\n".join(out)


def lines_loglog(title, xlabel, ylabel, series, width=640, height=360):
    """series: [(name, [(x, y), ...]), ...] on log-log axes."""
    left, right, top, bottom = 70, 20, 40, 70
    pw, ph = width - left - right, height - top - bottom
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    xlo, xhi = 10 ** math.floor(math.log10(min(xs))), 10 ** math.ceil(math.log10(max(xs)))
    ylo, yhi = 10 ** math.floor(math.log10(min(ys))), 10 ** math.ceil(math.log10(max(ys)))

    def px(x):
        return left + pw * (math.log10(x) - math.log10(xlo)) / (math.log10(xhi) - math.log10(xlo))

    def py(y):
        return top + ph * (1 - (math.log10(y) - math.log10(ylo)) / (math.log10(yhi) - math.log10(ylo)))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="20" text-anchor="middle" font-size="14">{_esc(title)}</text>',
           f'<text x="{left + pw / 2}" y="{top + ph + 32}" text-anchor="middle">{_esc(xlabel)}</text>',
           f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" text-anchor="middle">{_esc(ylabel)}</text>']
    for t in _ticks(ylo, yhi, True):
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 5}" y="{py(t) + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in _ticks(xlo, xhi, True):
        out.append(f'<line y1="{top}" y2="{top + ph}" x1="{px(t):.1f}" x2="{px(t):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{px(t):.1f}" y="{top + ph + 15}" text-anchor="middle">{_fmt(t)}</text>')
    for si, (name, pts) in enumerate(series):
        c = COLORS[si % 5]
        path = " ".join(f"{'M' if i == 0 else 'L'}{px(x):.1f},{py(y):.1f}" for i, (x, y) in enumerate(sorted(pts)))
        out.append(f'<path d="{path}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, y in pts:
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>')
        lx = left + si * 200
        out.append(f'<rect x="{lx}" y="{height - 20}" width="10" height="10" fill="{c}"/>')
        out.append(f'<text x="{lx + 14}" y="{height - 11}">{_esc(name)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="black"/>')
    out.append("</svg>")
    return "\n".join(out)
