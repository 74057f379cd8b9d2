"""Text that runs script or ends a ``<script>`` element when a page forgets to escape it: the
viz tests put it everywhere user text goes (tokens, titles, JSON inside the page)."""

XSS = "<img src=x onerror=alert(1)>"
CLOSER = "</script><script>alert(2)</script>"
