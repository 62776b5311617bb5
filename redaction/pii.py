"""Personal data rules: which addresses, card numbers and phone numbers are personal, offline.

- e-mail domains must end in a public suffix (tldextract's bundled list, as presidio checks it);
  reserved example domains are kept (``people.reserved_domain``);
- IP addresses: ``keep_ip`` (documentation, loopback, link-local ranges kept; private networks
  redacted by default; versions and section numbers are not addresses);
- card numbers: Luhn plus an issuer's prefix and length, written whole or grouped (``card_issued``);
- phone numbers: Google's libphonenumber metadata (``phonenumbers``, presidio's own dependency).

Presidio's ``AnalyzerEngine`` itself is built only for the baseline benchmark and, with a NER
model, for person names: its default loads a spaCy model from the network, so a blank English
pipeline (with a lemma component, so presidio's context words count) is saved to a cache folder
and passed as the model, and tldextract is told not to fetch the public-suffix list.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from functools import cache, lru_cache
from pathlib import Path

_CACHE = Path(os.environ.get("TRAJWH_CACHE", Path.home() / ".cache" / "trajwh"))


def _offline_tldextract() -> None:
    import tldextract
    import tldextract.tldextract as tx

    tx.TLD_EXTRACTOR = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


@cache
def _tld_extractor():
    import tldextract

    return tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)  # the bundled public-suffix snapshot


@lru_cache(maxsize=65536)
def public_domain(domain: str) -> bool:
    """Does ``domain`` end in a public suffix (what presidio's e-mail recognizer checks, with
    tldextract's bundled list, offline and with one extractor for the process)?"""
    return bool(_tld_extractor()(domain).fqdn)


#: documentation ranges (RFC 5737, RFC 3849): examples, never anybody's address
_DOC_NETS = [ipaddress.ip_network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "2001:db8::/32",
                                                 "198.18.0.0/15")]
_PRIVATE_NETS = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                                                     "fc00::/7")]


def keep_ip(value: str, before: str, after: str = "", *, redact_private: bool = True) -> bool:
    """Addresses that identify nobody are kept: loopback, link-local, unspecified, multicast,
    reserved and documentation ranges, and dotted numbers that are versions or section numbers
    (``pyerfa-2.0.1.5``, ``version 1.2.3.4``, ``==1.2.3.4``, ``4.1.2.3`` with single-digit parts).
    Private networks (RFC 1918, CGNAT, IPv6 ULA) are internal topology: redacted unless
    ``redact_private`` is off."""
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return True
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast or any(ip in n for n in _DOC_NETS):
        return True
    if any(ip in n for n in _PRIVATE_NETS):
        if not redact_private:
            return True
    elif ip.is_reserved or ip.is_private:
        return True
    if ip.version == 4:
        if re.fullmatch(r"\d\.\d\.\d\.\d", value):
            return True  # 1.2.3.4 / 4.1.2.3: versions and section numbers far more often than hosts
        if re.search(r"(?:\bv|version|ver\.?|release|==|>=|<=|~=|[\w)][-_])\s*$", before, re.I):
            return True
        if re.match(r"[-_.]?[a-z]|\.\d", after, re.I) and not re.match(r"[:/]", after):
            return True  # 2.0.1.5-cp39, 1.2.3.4.5, 1.2.3.4rc1
    return False


#: card issuers (IIN ranges) and the lengths each issues
_ISSUERS: list[tuple[re.Pattern[str], tuple[int, ...]]] = [
    (re.compile(r"4"), (13, 16, 19)),  # Visa
    (re.compile(r"5[1-5]|2(?:2[2-9][1-9]|2[3-9]\d|[3-6]\d\d|7[01]\d|720)"), (16,)),  # Mastercard
    (re.compile(r"3[47]"), (15,)),  # American Express
    (re.compile(r"6011|64[4-9]|65"), (16, 17, 18, 19)),  # Discover
    (re.compile(r"35(?:2[89]|[3-8]\d)"), (16, 17, 18, 19)),  # JCB
    (re.compile(r"30[0-5]|3[689]"), (14, 15, 16, 17, 18, 19)),  # Diners Club
    (re.compile(r"62"), (16, 17, 18, 19)),  # UnionPay
    (re.compile(r"5018|5020|5038|5893|6304|6759|676[1-3]"), (12, 13, 14, 15, 16, 17, 18, 19)),  # Maestro
]


def card_issued(digits: str, written: str) -> bool:
    """A Luhn-valid digit run is a card number only with an issuer's prefix and length, written
    whole or in the card's own grouping (4-4-4-4, Amex 4-6-5, 4-4-4-4-3)."""
    if not any(p.match(digits) and len(digits) in lengths for p, lengths in _ISSUERS):
        return False
    groups = [len(g) for g in re.split(r"[ -]", written.strip())]
    return len(groups) == 1 or groups in ([4, 4, 4, 4], [4, 6, 5], [4, 6, 4], [4, 4, 4, 4, 3], [4, 4, 4, 1], [4, 4, 4, 2],
                                          [4, 4, 4, 3], [4, 4, 4])


_PHONE_REGIONS = ("US", "GB", "DE", "FR", "IN", "AU", "JP", "BR", "ES", "IT", "NL", "CA", "MX", "PL", "SE", "CH", "CN",
                  "KR", "ZA", "NG", "IE", "AT", "BE", "PT", "RU", "TR")


def phone_number(candidate: str) -> bool:
    """Is this written number a telephone number? ``+CC ...`` must be a possible number of that
    country; the North American shape (``(415) 555-2671``, ``415-555-2671``) must follow the
    numbering plan (area code and exchange start with 2-9); a national number must start with a
    trunk prefix (``0...``) and be valid for one of the common regions (Google's libphonenumber
    metadata, through ``phonenumbers``)."""
    import phonenumbers

    digits = re.sub(r"\D", "", candidate)
    if not 8 <= len(digits) <= 15:
        return False
    if candidate.startswith("+"):
        try:
            return phonenumbers.is_possible_number(phonenumbers.parse(candidate, None))
        except phonenumbers.NumberParseException:
            return False
    if re.fullmatch(r"\(?[2-9]\d\d\)?[ .-]?[2-9]\d\d[ .-]\d{4}", candidate):
        return "(" in candidate or bool(re.fullmatch(r"\d{3}([.-])\d{3}\1\d{4}", candidate))
    if not digits.startswith("0"):
        return False
    for region in _PHONE_REGIONS:
        try:
            if phonenumbers.is_valid_number(phonenumbers.parse(candidate, region)):
                return True
        except phonenumbers.NumberParseException:
            continue
    return False


@cache
def blank_spacy_model_dir() -> str:
    """A saved blank English spaCy pipeline whose lemmas are the lower-cased tokens."""
    import spacy

    _register_lemma_component()
    target = _CACHE / "spacy-blank-en"
    if (target / "meta.json").exists():
        return str(target)
    nlp = spacy.blank("en")
    nlp.add_pipe("trajwh_lemma")
    target.parent.mkdir(parents=True, exist_ok=True)
    nlp.to_disk(target)
    return str(target)


def _register_lemma_component() -> None:
    from spacy.language import Language

    if "trajwh_lemma" not in Language.factories:
        @Language.component("trajwh_lemma")
        def _lemma(doc):  # pragma: no cover - runs inside spaCy
            for token in doc:
                token.lemma_ = token.lower_
            return doc


@cache
def presidio_analyzer():
    """Presidio's default AnalyzerEngine, offline (the benchmark baseline)."""
    _offline_tldextract()
    logging.getLogger("presidio-analyzer").setLevel(logging.ERROR)
    from presidio_analyzer import AnalyzerEngine
    from presidio_analyzer.nlp_engine import NlpEngineProvider

    _register_lemma_component()
    model_dir = blank_spacy_model_dir()
    provider = NlpEngineProvider(nlp_configuration={
        "nlp_engine_name": "spacy", "models": [{"lang_code": "en", "model_name": model_dir}]})
    return AnalyzerEngine(nlp_engine=provider.create_engine(), supported_languages=["en"])


ENV_NER = "TRAJWH_NER_MODEL"


def _installed(distribution: str) -> bool:
    """Whether a Python distribution is installed (what ``spacy.util.is_package`` asks)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import distribution as find

    try:
        find(distribution)
    except PackageNotFoundError:
        return False
    return True


@cache
def person_analyzer():
    """Presidio with a NER-capable spaCy pipeline, when one is installed: ``$TRAJWH_NER_MODEL`` (a
    package name or a folder), else ``en_core_web_sm`` if present. None otherwise (offline default:
    person names are then not detected, and the docs say so)."""
    # whether the default model is installed, without importing spaCy (about 1 s, and 4-5 s on a
    # busy machine, in every process that redacts or checks: most machines have no NER model)
    model = os.environ.get(ENV_NER) or ("en_core_web_sm" if _installed("en_core_web_sm") else None)
    if not model:
        return None
    _offline_tldextract()
    _register_lemma_component()
    logging.getLogger("presidio-analyzer").setLevel(logging.ERROR)
    from presidio_analyzer import AnalyzerEngine
    from presidio_analyzer.nlp_engine import NlpEngineProvider

    provider = NlpEngineProvider(nlp_configuration={
        "nlp_engine_name": "spacy", "models": [{"lang_code": "en", "model_name": model}],
        "ner_model_configuration": {"labels_to_ignore": [], "model_to_presidio_entity_mapping": {"PERSON": "PERSON", "PER": "PERSON"}}})
    return AnalyzerEngine(nlp_engine=provider.create_engine(), supported_languages=["en"])
