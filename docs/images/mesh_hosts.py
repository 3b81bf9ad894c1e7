"""Draw ``mesh-hosts.svg``: {"data": 2, "model": 4} on 2 hosts with interleaved ranks.

The grids come from `order_devices` itself (without and with the host table), so the picture
follows the code; ``tests/test_mesh_hosts.py`` checks that the committed file is this script's
output. Run ``python docs/images/mesh_hosts.py`` to redraw it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from meshkit._src.sharding.mesh import order_devices

OUT = Path(__file__).with_name("mesh-hosts.svg")
HOST_OF = [0, 1, 0, 1]  # processes 0, 2 on node-a; 1, 3 on node-b
HOSTS = ("node-a", "node-b")
COLORS = ("#cfe2f3", "#fce5cd")
STROKES = ("#3d85c6", "#e69138")
CELL_W, CELL_H, GAP = 78, 40, 60
LEFT, TOP = 70, 70


def devices() -> list[SimpleNamespace]:
    """4 processes x 2 devices, ids numbered as JAX numbers CPU devices of 4 processes."""
    return [SimpleNamespace(id=2048 * p + i, process_index=p) for p in range(4) for i in range(2)]


def panel(x0: int, title: str, grid, note: str) -> list[str]:
    """One 2 x 4 grid at ``x0``, its cells coloured by host."""
    out = [f'<text x="{x0 + 2 * CELL_W}" y="{TOP - 40}" class="t">{title}</text>']
    for j in range(4):
        out.append(
            f'<text x="{x0 + j * CELL_W + CELL_W / 2}" y="{TOP - 10}" class="l">model={j}</text>'
        )
    for i in range(2):
        y = TOP + i * CELL_H
        out.append(f'<text x="{x0 - 8}" y="{y + CELL_H / 2 + 5}" class="r">data={i}</text>')
        for j in range(4):
            d = grid[i, j]
            h = HOST_OF[d.process_index]
            x = x0 + j * CELL_W
            out.append(
                f'<rect x="{x}" y="{y}" width="{CELL_W}" height="{CELL_H}" '
                f'fill="{COLORS[h]}" stroke="{STROKES[h]}" stroke-width="1.5"/>'
            )
            out.append(
                f'<text x="{x + CELL_W / 2}" y="{y + CELL_H / 2 + 5}" class="c">'
                f"p{d.process_index}/d{d.id}</text>"
            )
    out.append(f'<text x="{x0 + 2 * CELL_W}" y="{TOP + 2 * CELL_H + 28}" class="t2">{note}</text>')
    return out


def svg() -> str:
    """The picture: the mesh by rank alone, and by host (meshkit), side by side."""
    devs = devices()
    by_rank = order_devices(devs, (2, 4))
    by_host = order_devices(devs, (2, 4), host_of=HOST_OF)
    width = LEFT + 2 * 4 * CELL_W + GAP + 20
    height = TOP + 2 * CELL_H + 90
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">',
        "<style>.t{font-size:15px;font-weight:bold;text-anchor:middle}"
        ".t2{font-size:13px;text-anchor:middle}.l{font-size:12px;text-anchor:middle}"
        ".r{font-size:12px;text-anchor:end}.c{font-size:12px;text-anchor:middle}</style>",
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    parts += panel(LEFT, "by rank alone", by_rank, "every row (model) spans both hosts")
    parts += panel(
        LEFT + 4 * CELL_W + GAP, "meshkit: by host", by_host, "each row (model) inside one host"
    )
    y = height - 22
    for h, name in enumerate(HOSTS):
        x = LEFT + h * 250
        parts.append(
            f'<rect x="{x}" y="{y - 12}" width="16" height="16" fill="{COLORS[h]}" '
            f'stroke="{STROKES[h]}"/>'
        )
        parts.append(
            f'<text x="{x + 22}" y="{y + 1}" font-size="12">{name}: processes '
            f"{', '.join(str(p) for p in range(4) if HOST_OF[p] == h)}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    OUT.write_text(svg())
    print(f"wrote {OUT}")
