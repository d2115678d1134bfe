"""The spec's ``cost`` section: the prices and power figures each training launch is accounted at."""

from __future__ import annotations

from pydantic import Field, model_validator

from trainforge.sections import SpecModel, field_errors


class CostSection(SpecModel):
    """Prices and power used to account each training launch (logged to the MLflow run).

    The price comes from, first match wins: ``price_per_hour``; non-zero ``gpu_hour_price`` /
    ``cpu_hour_price``; the price catalog row of ``cloud`` and ``instance_type``
    (trainforge.ledger.catalog). Power figures are used where energy is not measured.
    """

    gpu_hour_price: float = Field(0.0, ge=0, description="Price of one GPU-hour, in currency.")
    cpu_hour_price: float = Field(0.0, ge=0, description="Price of one CPU-core-hour.")
    currency: str = Field("USD", min_length=1, max_length=8, description="Currency of the prices.")
    gpu_power_watts: float = Field(
        700.0, ge=0, description="Average board power of one GPU while training, watts "
        "(default: the H100/H200 SXM TDP)."
    )
    cpu_core_power_watts: float = Field(
        10.0, ge=0, description="Average power of one busy CPU core, watts."
    )
    cloud: str | None = Field(
        None, min_length=1, description="Cloud of the price catalog row (trainforge/ledger/"
        "prices.csv); default: the engine's ('local' for the local engine)."
    )
    instance_type: str | None = Field(
        None, min_length=1, description="Machine type of the price catalog row, e.g. "
        "p5.48xlarge; default: the cloud's only row."
    )
    price_per_hour: float | None = Field(
        None, ge=0, description="Price of one machine-hour, in currency; overrides the catalog "
        "and the per-device prices."
    )

    @model_validator(mode="after")
    def _currency(self) -> CostSection:
        own = self.price_per_hour is not None or self.gpu_hour_price or self.cpu_hour_price
        if self.currency != "USD" and not own:  # the catalog's rows are priced in USD
            raise field_errors(CostSection, (
                ("currency",), f"currency is the currency of the spec's own prices, and none is "
                f"given: the price comes from the catalog row, in that row's currency (got "
                f"currency {self.currency!r}; expected price_per_hour, gpu_hour_price or "
                f"cpu_hour_price in it, or no currency)", self.currency, ()))
        return self
