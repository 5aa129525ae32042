"""The report's pages: markdown and self-contained HTML (render) and its inline SVG figures
(figures), drawn from the numbers of stages.evaluation."""
