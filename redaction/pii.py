"""Personal data through presidio-analyzer's own recognizers, set up to work offline.

Presidio's default ``AnalyzerEngine`` loads a spaCy model from the network; here a blank
English pipeline (with a lemma component, so presidio's context words count) is saved to a cache
folder and passed as the model, and tldextract is told not to fetch the public-suffix list.
Presidio's pattern recognizers (email, phone, IP, credit card with Luhn check) are called
directly on candidate windows by the fast path; the full engine is built only for the baseline
benchmark and for users who want it.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from functools import cache
from pathlib import Path

_CACHE = Path(os.environ.get("TRAJWH_CACHE", Path.home() / ".cache" / "trajwh"))


def _offline_tldextract() -> None:
    import tldextract
    import tldextract.tldextract as tx

    tx.TLD_EXTRACTOR = tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


@cache
def pii_recognizers() -> dict[str, object]:
    """Presidio recognizers by our entity type."""
    _offline_tldextract()
    logging.getLogger("presidio-analyzer").setLevel(logging.ERROR)
    from presidio_analyzer.predefined_recognizers import (
        CreditCardRecognizer,
        EmailRecognizer,
        IpRecognizer,
        PhoneRecognizer,
    )

    return {"EMAIL": EmailRecognizer(), "PHONE": PhoneRecognizer(), "IP_ADDRESS": IpRecognizer(),
            "CREDIT_CARD": CreditCardRecognizer()}


PRESIDIO_ENTITY = {"EMAIL": "EMAIL_ADDRESS", "PHONE": "PHONE_NUMBER", "IP_ADDRESS": "IP_ADDRESS",
                   "CREDIT_CARD": "CREDIT_CARD"}


def keep_ip(value: str, before: str) -> bool:
    """Addresses that identify nobody: loopback, private, link-local, unspecified, and dotted
    version numbers (``version 1.2.3.4``, ``==1.2.3.4``)."""
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        return True
    if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return True
    return bool(re.search(r"(?:v|version|==|>=|<=|@|ver\.?)\s*$", before, re.I))


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


@cache
def person_analyzer():
    """Presidio with a NER-capable spaCy pipeline, when one is installed: ``$TRAJWH_NER_MODEL`` (a
    package name or a folder), else ``en_core_web_sm`` if present. None otherwise (offline default:
    person names are then not detected, and the docs say so)."""
    import spacy

    model = os.environ.get(ENV_NER) or ("en_core_web_sm" if spacy.util.is_package("en_core_web_sm") else None)
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
