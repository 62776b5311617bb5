"""SWE-bench companion files: the verdicts and predictions that live beside trajectories.

- ``report.json`` (the evaluation harness's per-instance report, keyed by instance id or, as
  some exports write it, flat in a file named ``<instance_id>.report.json`` / in a folder
  named after the instance): resolved flag, patch applied, FAIL_TO_PASS / PASS_TO_PASS results.
- ``results_summary.json``: resolved and patch-applied flags for every instance of a run.
- ``all_preds.jsonl``: predictions (model name and patch) per instance.

They give facts, not episodes: the trajectory adapters look them up by instance id.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from trajwh.ingest.adapters.base import Adapter, ParsedEpisode, RecordContext
from trajwh.ingest.adapters.common import file_stem
from trajwh.schemas import ids

_BUCKETS = {"FAIL_TO_PASS": "failed", "PASS_TO_PASS": "passed", "FAIL_TO_FAIL": "failed", "PASS_TO_FAIL": "passed"}


def _report_facts(report: dict[str, Any]) -> dict[str, Any]:
    tests = []
    for bucket, results in (report.get("tests_status") or {}).items():
        for status, names in (results or {}).items():
            for name in names or []:
                tests.append({"name": name, "status": "passed" if status == "success" else "failed",
                              "bucket": bucket})
    return {"swebench_report": {
        "resolved": report.get("resolved"),
        "patch_applied": report.get("patch_successfully_applied"),
        "patch_exists": report.get("patch_exists"),
        "test_results": tests,
    }}


class _Companion(Adapter):
    companion = True

    def parse(self, obj: Any, ctx: RecordContext) -> list[ParsedEpisode]:
        return []


class SwebenchReportAdapter(_Companion):
    name = "swebench-report"
    version = "1.0.0"
    framing = "document"
    description = "SWE-bench evaluation report.json (verdict per instance)"

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"tests_status"' in head and b'"resolved"' in head

    def check_record(self, obj: Any) -> str | None:
        return None if isinstance(obj, dict) else "a report is a JSON object"

    def facts(self, obj: Any, ctx: RecordContext) -> list[tuple[str, str, dict[str, Any]]]:
        if "tests_status" in obj or "resolved" in obj:  # flat: the instance id is in the file name
            name = file_stem(ctx.file_path, (".report.json",))
            if name == "report.json":
                name = PurePath(ctx.file_path).parent.name
            return [("instance_id", name, _report_facts(obj))]
        return [("instance_id", iid, _report_facts(rep)) for iid, rep in obj.items() if isinstance(rep, dict)]


class SwebenchSummaryAdapter(_Companion):
    name = "swebench-summary"
    version = "1.0.0"
    framing = "document"
    description = "results_summary.json of a SWE-bench run (resolved flag per instance)"

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"instances"' in head and b'"instance_id"' in head and b'"resolved"' in head

    def check_record(self, obj: Any) -> str | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("instances"), list):
            return "expected an object with an 'instances' list"
        return None

    def facts(self, obj: Any, ctx: RecordContext) -> list[tuple[str, str, dict[str, Any]]]:
        return [("instance_id", i["instance_id"],
                 {"swebench_summary": {"resolved": i.get("resolved"), "patch_applied": i.get("patch_applied")}})
                for i in obj["instances"] if isinstance(i, dict) and i.get("instance_id")]


class SwebenchPredictionsAdapter(_Companion):
    name = "swebench-predictions"
    version = "1.1.0"
    framing = "jsonl"
    description = "SWE-bench predictions (all_preds.jsonl / preds.json lines)"

    def sniff(self, path: str, head: bytes) -> bool:
        return head.lstrip()[:1] == b"{" and b'"model_patch"' in head and b'"instance_id"' in head

    def check_record(self, obj: Any) -> str | None:
        if not _predictions(obj):
            return ("a prediction is an object with an instance_id (all_preds.jsonl), or an object of them "
                    "keyed by instance id (preds.json)")
        return None

    def facts(self, obj: Any, ctx: RecordContext) -> list[tuple[str, str, dict[str, Any]]]:
        """By instance id, and by folder + patch digest: a trajectory whose submission is this
        patch is this prediction's run (old SWE-agent files carry no instance id themselves)."""
        out = []
        for p in _predictions(obj):
            pred = {"instance_id": p["instance_id"], "model_name_or_path": p.get("model_name_or_path"),
                    "patch_sha256": patch_digest(p.get("model_patch") or "")}
            out += [("instance_id", p["instance_id"], {"prediction": pred}),
                    ("dir", str(PurePath(ctx.file_path).parent), {"predictions": {pred["patch_sha256"]: pred}})]
        return out


def _predictions(obj: Any) -> list[dict[str, Any]]:
    """One prediction (a line of all_preds.jsonl) or many (preds.json: {instance_id: prediction})."""
    if not isinstance(obj, dict):
        return []
    if "instance_id" in obj:
        return [obj]
    preds = [{"instance_id": key, **value} for key, value in obj.items() if isinstance(value, dict)
             and ("model_patch" in value or "instance_id" in value)]
    return preds if preds and len(preds) == len(obj) else []


def patch_digest(patch: str) -> str:
    """Digest of a patch, blind to line endings and surrounding blank lines."""
    return ids.sha256_hex(patch.replace("\r\n", "\n").strip().encode())


def verdict_for(ctx: RecordContext, instance_id: str | None) -> dict[str, Any]:
    """Outcome columns from the companions of ``instance_id`` (report first, then summary)."""
    if not instance_id:
        return {}
    facts = ctx.facts("instance_id", instance_id)
    report, summary = facts.get("swebench_report"), facts.get("swebench_summary")
    if report:
        return {"resolved": report.get("resolved"), "verifier_status": "ok", "verifier_name": "swebench",
                "test_results": [{"name": t["name"], "status": t["status"]} for t in report["test_results"]] or None,
                "_verdict_from": "report.json"}
    if summary:
        return {"resolved": summary.get("resolved"), "verifier_status": "ok", "verifier_name": "swebench",
                "_verdict_from": "results_summary.json"}
    return {}


