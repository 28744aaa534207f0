"""Views of a comparison, one module per output: compare.json (jsonfile.py), the rich terminal tables
(terminal.py), and a self-contained report.html (page.py with the jinja2 templates `*.html.jinja` beside it,
plots.py for its embedded PNGs). text.py holds the number formats and headline sentences they share."""

from evalpipe.compare.report.jsonfile import write_json
from evalpipe.compare.report.page import render_html, write_html
from evalpipe.compare.report.terminal import print_terminal
from evalpipe.compare.report.text import headline_lines, verdict_summary

__all__ = ["headline_lines", "print_terminal", "render_html", "verdict_summary", "write_html", "write_json"]
