"""The HTML page's stylesheet and script (static text)."""

CSS = """
:root {
  --fg: #1f2937; --muted: #6b7280; --line: #e5e7eb; --bg: #f6f7f9; --card: #ffffff;
  --agree-bg: #eceff3; --agree-bd: #c3c9d2;
  --rag-bg: #dcf5e3; --rag-bd: #16a34a; --rag-fg: #14532d;
  --pure-bg: #dde9fd; --pure-bd: #2563eb; --pure-fg: #1e3a8a;
  --other-bg: #fdf0d2; --other-bd: #d97706; --other-fg: #78350f;
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 15px/1.5 -apple-system, BlinkMacSystemFont, "Segoe UI", Roboto, "Helvetica Neue",
  Arial, sans-serif; }
main { max-width: 1000px; margin: 0 auto; padding: 28px 24px 48px; }
header.top { display: flex; align-items: baseline; justify-content: space-between;
  gap: 16px; margin-bottom: 18px; }
header.top h1 { font-size: 20px; margin: 0; letter-spacing: -0.01em; }
header.top .meta { color: var(--muted); font-size: 13px; }
section.card { background: var(--card); border: 1px solid var(--line); border-radius: 10px;
  padding: 18px 22px; margin-bottom: 16px; box-shadow: 0 1px 2px rgba(16, 24, 40, 0.04); }
h2 { font-size: 12px; text-transform: uppercase; letter-spacing: 0.06em; color: var(--muted);
  margin: 0 0 10px; font-weight: 600; }
.question { font-size: 18px; font-weight: 600; white-space: pre-wrap; overflow-wrap: anywhere; }
.answer { font-size: 17px; line-height: 2.1; white-space: pre-wrap; overflow-wrap: anywhere; }
.tok { position: relative; border-radius: 3px; padding: 2px 0; cursor: help;
  border-bottom: 2px solid transparent; outline: none; }
.tok.src-agree { background: var(--agree-bg); }
.tok.src-rag { background: var(--rag-bg); border-bottom-color: var(--rag-bd); color: var(--rag-fg); }
.tok.src-pure { background: var(--pure-bg); border-bottom-color: var(--pure-bd); color: var(--pure-fg); }
.tok.src-other { background: var(--other-bg); border-bottom-color: var(--other-bd);
  color: var(--other-fg); }
.tok.dis { box-shadow: inset 0 -4px 0 -2px rgba(0, 0, 0, 0.25); }
.tok:hover, .tok:focus { filter: brightness(0.93); }
.tok .ws, .ctext .ws { color: var(--muted); font-size: 0.8em; }
.tok .tip { display: none; position: absolute; left: 0; top: calc(100% + 6px); z-index: 20;
  min-width: 240px; max-width: 360px; background: #111827; color: #f3f4f6;
  font: 12px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  white-space: normal; overflow-wrap: normal; word-break: normal; padding: 9px 11px;
  border-radius: 7px; cursor: default; box-shadow: 0 8px 24px rgba(0, 0, 0, 0.25); }
.tok:hover .tip, .tok:focus .tip, .tok.pinned .tip { display: block; }
.tip .th { font-weight: 700; margin-bottom: 4px; color: #fff; }
.tip table { border-collapse: collapse; width: 100%; }
.tip td { padding: 1px 6px 1px 0; vertical-align: top; }
.tip td.k { color: #9ca3af; white-space: nowrap; }
.tip .sep { border-top: 1px solid #374151; margin: 5px 0; }
.tip .chosen { color: #86efac; }
.legend { display: flex; flex-wrap: wrap; gap: 8px 18px; margin-top: 14px; font-size: 13px;
  color: var(--muted); }
.legend .sw { display: inline-block; width: 14px; height: 14px; border-radius: 3px;
  vertical-align: -2px; margin-right: 6px; border-bottom: 2px solid transparent; }
.sw.src-agree { background: var(--agree-bg); border-color: var(--agree-bd); }
.sw.src-rag { background: var(--rag-bg); border-color: var(--rag-bd); }
.sw.src-pure { background: var(--pure-bg); border-color: var(--pure-bd); }
.sw.src-other { background: var(--other-bg); border-color: var(--other-bd); }
.stats { display: grid; grid-template-columns: repeat(auto-fit, minmax(150px, 1fr)); gap: 12px; }
.stat { border: 1px solid var(--line); border-radius: 8px; padding: 10px 12px; }
.stat .k { font-size: 12px; color: var(--muted); }
.stat .v { font-size: 15px; font-weight: 600; overflow-wrap: break-word; white-space: pre-line; }
.bar { display: flex; height: 10px; border-radius: 5px; overflow: hidden; margin: 14px 0 6px;
  background: var(--line); }
.bar span { display: block; height: 100%; }
.bar .src-agree { background: #b6bec9; } .bar .src-rag { background: var(--rag-bd); }
.bar .src-pure { background: var(--pure-bd); } .bar .src-other { background: var(--other-bd); }
.chips { display: flex; flex-wrap: wrap; gap: 8px; font-size: 13px; }
.chip { border-radius: 999px; padding: 2px 10px; border: 1px solid var(--line); }
.chip.src-agree { background: var(--agree-bg); } .chip.src-rag { background: var(--rag-bg); }
.chip.src-pure { background: var(--pure-bg); } .chip.src-other { background: var(--other-bg); }
.warnings { background: #fffbeb; border-color: #fcd34d; }
.warnings ul { margin: 0; padding-left: 20px; }
.warnings li { color: #78350f; margin: 2px 0; white-space: pre-wrap; }
table.data { border-collapse: collapse; width: 100%; font-size: 13px; }
table.data th { text-align: left; font-weight: 600; color: var(--muted); font-size: 12px;
  border-bottom: 1px solid var(--line); padding: 6px 8px; white-space: nowrap; }
table.data td { border-bottom: 1px solid var(--line); padding: 6px 8px; vertical-align: top; }
table.data tr:last-child td { border-bottom: none; }
.scroll { overflow-x: auto; max-width: 100%; }
table.data td.txt { white-space: normal; overflow-wrap: break-word; min-width: 10ch;
  max-width: 28ch; font: 12px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
table.data td.num { text-align: right; font-variant-numeric: tabular-nums;
  font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; white-space: nowrap; }
code.ctext { font: 12.5px ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
  white-space: pre; background: #f3f4f6; border: 1px solid var(--line); border-radius: 4px;
  padding: 1px 4px; }
code.ctext.win { border-color: #111827; }
.prob { color: var(--muted); font-size: 12px; margin-left: 4px; }
.badge { display: inline-block; border-radius: 4px; padding: 0 6px; font-size: 12px;
  font-weight: 600; border: 1px solid var(--line); white-space: nowrap; }
.badge.src-agree { background: var(--agree-bg); } .badge.src-rag { background: var(--rag-bg);
  color: var(--rag-fg); } .badge.src-pure { background: var(--pure-bg); color: var(--pure-fg); }
.badge.src-other { background: var(--other-bg); color: var(--other-fg); }
.badge.kept { background: #dcfce7; color: #166534; } .badge.cut { background: #fef3c7;
  color: #92400e; } .badge.dropped { background: #fee2e2; color: #991b1b; }
details summary { cursor: pointer; color: var(--muted); font-size: 13px; }
.ptext { white-space: pre-wrap; overflow-wrap: anywhere; font-size: 13px; margin: 6px 0 0;
  color: #374151; }
.muted { color: var(--muted); }
tr.hl td { background: #fffbe6; }
"""

# Clicking a token pins its tooltip (useful on touch screens); clicking again unpins it.
JS = """
document.querySelectorAll('.tok').forEach(function (t) {
  t.addEventListener('click', function (e) {
    if (e.target.closest('.tip')) return;
    var on = t.classList.contains('pinned');
    document.querySelectorAll('.tok.pinned').forEach(function (o) { o.classList.remove('pinned'); });
    if (!on) t.classList.add('pinned');
  });
});
"""

