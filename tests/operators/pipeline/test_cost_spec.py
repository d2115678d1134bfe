"""The spec's cost section: a currency only with prices of the spec's own."""

from __future__ import annotations

import pytest

from tests.operators.pipeline.test_loader import MINIMAL
from trainforge.pipeline import SpecError, parse_spec_text


def _spec(cost: str) -> str:
    return MINIMAL + f"cost:\n{cost}"


def test_a_currency_without_prices_of_the_specs_own_is_refused_at_its_line():
    with pytest.raises(SpecError) as info:
        parse_spec_text(_spec("  cloud: aws\n  currency: EUR\n"), "cost.yaml")
    (issue,) = [i for i in info.value.issues if i.path == "cost.currency"]
    assert issue.line == 17 and "got currency 'EUR'" in issue.message, str(issue)
    assert "the price comes from the catalog row" in issue.message


@pytest.mark.parametrize("cost", ["  currency: EUR\n  price_per_hour: 3.5\n",
                                  "  currency: EUR\n  gpu_hour_price: 2.5\n",
                                  "  currency: USD\n", "  cloud: aws\n"])
def test_a_currency_with_its_own_prices_or_the_catalogs_passes(cost):
    spec = parse_spec_text(_spec(cost), "cost.yaml")
    assert spec.cost.currency in ("EUR", "USD")
