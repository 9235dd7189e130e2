"""The registry view moved to ``runtime/tenancy.py``, below the gateways and the abuse detector that both follow
it; this name stays for the modules that still import it from here."""

from runtime.tenancy import ApiKey, Refusal, TenancyView

__all__ = ["ApiKey", "Refusal", "TenancyView"]
