"""The provider offers the scale simulation is fed: consistent with the catalog and the docs."""

from pathlib import Path

from hardware import CATALOG, OFFERS, PROVIDER_SOURCES, offers_markdown

DOCS = Path(__file__).resolve().parents[3] / "docs" / "fleet-simulation.md"


def test_offers_name_catalog_gpus_and_spot_is_cheaper():
    assert len({o.provider for o in OFFERS.values()}) == 3
    assert len({o.gpu for o in OFFERS.values()}) == 5
    for name, o in OFFERS.items():
        assert o.gpu in CATALOG, name
        assert o.on_demand_per_hour > 0 and o.link_gbps > 0, name
        if o.spot_per_hour is not None:
            assert 0 < o.spot_per_hour < o.on_demand_per_hour, name


def test_every_price_names_a_source_or_says_estimate():
    for name, o in OFFERS.items():
        cited = [key for key in (*PROVIDER_SOURCES, "S6", "S7") if key in o.basis]
        assert cited, f"{name}: no source key in {o.basis!r}"
        assert "estimate" in o.basis, f"{name}: the link figure must be marked as an estimate"


def test_docs_show_the_offers_as_the_code_has_them():
    page = DOCS.read_text()
    for line in offers_markdown().splitlines():
        if line.startswith("| ") or line.startswith("- P"):
            assert line in page, f"docs/fleet-simulation.md is out of date: missing {line!r}"
