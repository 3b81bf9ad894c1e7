"""``meshkit migrate``: find pmap-era code, explain it, rewrite it (scan, flow, rules, fix)."""
