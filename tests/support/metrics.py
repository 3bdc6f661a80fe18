"""Reading a service's ``/metrics`` page back, for the checks of what it reports."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(
    url: str, timeout_s: float = 10.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Fetch a ``/metrics`` page: ``{(sample name, sorted label pairs): value}``; e.g. the
    route bytes a route cache served, ``scrape(url)[("route_cache_route_bytes_served_total",
    ())]``."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
