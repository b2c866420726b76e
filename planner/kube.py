"""The Kubernetes actuator: the planner's decision becomes `spec.replicas` of the prefill and decode
Deployments, set through their scale subresource (GET/PATCH .../deployments/{name}/scale).

Plain HTTPS with httpx (a dependency already) rather than the kubernetes client library: four calls do
not justify its weight (and its own pins of urllib3, google-auth, ...) in the router image the planner
runs from. Credentials are the pod's service account (KUBERNETES_SERVICE_HOST/PORT, the token and CA files
under /var/run/secrets/kubernetes.io/serviceaccount) or explicit ones; the token file is read again for
every call, since the kubelet rotates the projected token.

Each round, per role: GET the scale (what the Deployment asks for), PATCH it only when the decision
differs (with the resourceVersion read, so a concurrent change is a 409, not overwritten), then GET the
Deployment for what actually runs (status.replicas, readyReplicas), which goes into the decision log.
An API error (403 from RBAC, 404 for a wrong name, 409, 5xx, a timeout) is logged once per kind, with the
status and the API's own message, and the call is tried again next round: it never stops the planner.
The policy's floor is asserted again here: a decision below a role's minimum is raised to it, never sent.
A hold (the policy's answer to missing or stale signals) keeps what the Deployments run, raised to the
floor: a planner started during a metrics outage must not scale a release down to its minimum.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from planner.policy import Decision

log = logging.getLogger("splitserve.planner")
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
ROLES = ("prefill", "decode")


class ApiError(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclass(frozen=True)
class KubeTarget:
    api: str  # https://host:port
    token_file: Path
    ca_file: Path | None  # None: the system's trust store
    namespace: str
    deployments: dict[str, str]  # role -> Deployment name
    timeout_s: float = 5.0

    @classmethod
    def from_args(
        cls,
        namespace: str | None,
        prefill: str,
        decode: str,
        api: str | None = None,
        token_file: str | None = None,
        ca_file: str | None = None,
    ) -> KubeTarget:
        """Explicit settings where given, else the pod's own (in-cluster). ValueError says what is missing."""
        in_cluster = api is None
        if api is None:
            host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
            if not host:
                raise ValueError("not in a pod (no KUBERNETES_SERVICE_HOST): give --kube-api")
            api = f"https://{f'[{host}]' if ':' in host else host}:{port or 443}"
        if namespace is None and (SA_DIR / "namespace").is_file():
            namespace = (SA_DIR / "namespace").read_text().strip()
        if not namespace:
            raise ValueError("--namespace: the namespace of the Deployments")
        if not prefill or not decode:
            raise ValueError("--prefill-deployment and --decode-deployment: the Deployments to scale")
        token = Path(token_file) if token_file else SA_DIR / "token"
        # in a pod the API's certificate is signed by the cluster's CA; elsewhere the system's trust store
        ca = Path(ca_file) if ca_file else (SA_DIR / "ca.crt" if in_cluster else None)
        return cls(api.rstrip("/"), token, ca, namespace, {"prefill": prefill, "decode": decode})


class KubeActuator:
    """Sets the Deployments' replicas to each decision, never below `floors` (role -> minimum)."""

    def __init__(self, target: KubeTarget, floors: dict[str, int]) -> None:
        self.target, self.floors = target, floors
        self.client: httpx.AsyncClient | None = None  # made at the first call: the CA file may come late
        self.spec: dict[str, int | None] = dict.fromkeys(ROLES)  # the last replicas the API reported
        self._failing: set[str] = set()  # error kinds already logged, until that call succeeds again

    def _path(self, role: str, scale: bool) -> str:
        t = self.target
        path = f"/apis/apps/v1/namespaces/{t.namespace}/deployments/{t.deployments[role]}"
        return path + "/scale" if scale else path

    async def _call(self, method: str, role: str, scale: bool, body: dict[str, Any] | None = None) -> Any:
        """One API call; ApiError with the status and the API's message (or the transport error)."""
        try:
            token = self.target.token_file.read_text().strip()  # rotates: read it every time
        except OSError as e:
            raise ApiError("token", f"{self.target.token_file}: {e.strerror}") from None
        headers = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
        content = None
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
            content = json.dumps(body)
        if self.client is None:
            verify: ssl.SSLContext | bool = True
            if self.target.ca_file is not None:
                try:
                    verify = ssl.create_default_context(cafile=str(self.target.ca_file))
                except (OSError, ssl.SSLError) as e:
                    raise ApiError("ca", f"{self.target.ca_file}: {e}") from None
            self.client = httpx.AsyncClient(
                base_url=self.target.api, verify=verify, timeout=self.target.timeout_s
            )
        try:
            r = await self.client.request(method, self._path(role, scale), headers=headers, content=content)
        except httpx.TimeoutException:
            raise ApiError("timeout", f"no answer within {self.target.timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise ApiError(type(e).__name__, str(e) or type(e).__name__) from None
        if r.status_code >= 400:
            try:
                message = r.json().get("message", r.text)  # a Kubernetes Status object
            except ValueError:
                message = r.text
            raise ApiError(str(r.status_code), str(message)[:300])
        return r.json()

    def _report(self, what: str, e: ApiError) -> None:
        kind = f"{what} {e.kind}"
        if kind not in self._failing:
            self._failing.add(kind)
            log.warning("kubernetes: %s failed (%s): %s; trying again next round", what, e.kind, e.detail)

    def _ok(self, what: str) -> None:
        cleared = {k for k in self._failing if k.startswith(what + " ")}
        if cleared:
            self._failing -= cleared
            log.info("kubernetes: %s works again", what)

    async def read(self, role: str) -> tuple[int, str] | None:
        """The Deployment's spec.replicas and resourceVersion, from its scale; None on an API error."""
        what = f"get {self.target.deployments[role]}/scale"
        try:
            scale = await self._call("GET", role, scale=True)
        except ApiError as e:
            self._report(what, e)
            return None
        self._ok(what)
        spec = self.spec[role] = int(scale.get("spec", {}).get("replicas", 0))
        return spec, str(scale.get("metadata", {}).get("resourceVersion", ""))

    async def start(self) -> None:
        """Reads (and logs) what the Deployments ask for before the first decision."""
        for role in ROLES:
            if (got := await self.read(role)) is not None:
                log.info("kubernetes: %s runs %d replicas", self.target.deployments[role], got[0])

    async def apply(self, d: Decision) -> dict[str, Any]:
        """Each role's replicas set to the decision (only where they differ); what runs, for the log."""
        out: dict[str, Any] = {}
        for role in ROLES:
            wanted = getattr(d, role)
            if not d.inputs:  # a hold (signals missing or stale: policy.Planner._hold) changes nothing
                wanted = None
            elif wanted < self.floors[role]:  # the policy never does this: if it ever did, hold the floor
                log.error(
                    "decision below min_%s (%d < %d): using the minimum", role, wanted, self.floors[role]
                )
                wanted = self.floors[role]
            out[role] = {"deployment": self.target.deployments[role]}
            out[role] |= await self._set(role, wanted) | await self._status(role)
        return out

    async def _set(self, role: str, wanted: int | None) -> dict[str, Any]:
        got = await self.read(role)
        if got is None:
            return {"wanted": wanted, "error": "could not read the scale"}
        spec, version = got
        if wanted is None:  # holding: what runs stays, but never under the floor
            wanted = max(spec, self.floors[role])
        if spec == wanted:
            return {"wanted": wanted, "spec": spec}
        what = f"patch {self.target.deployments[role]}/scale"
        body = {"metadata": {"resourceVersion": version}, "spec": {"replicas": wanted}}
        try:
            scale = await self._call("PATCH", role, scale=True, body=body)
        except ApiError as e:
            self._report(what, e)
            return {"wanted": wanted, "spec": spec, "error": f"{e.kind}: {e.detail}"}
        self._ok(what)
        self.spec[role] = int(scale.get("spec", {}).get("replicas", wanted))
        log.info("kubernetes: %s replicas %d -> %d", self.target.deployments[role], spec, self.spec[role])
        return {"wanted": wanted, "spec": self.spec[role], "patched_from": spec}

    async def _status(self, role: str) -> dict[str, Any]:
        what = f"get {self.target.deployments[role]}"
        try:
            status = (await self._call("GET", role, scale=False)).get("status", {})
        except ApiError as e:
            self._report(what, e)
            return {}
        self._ok(what)
        return {"replicas": int(status.get("replicas", 0)), "ready": int(status.get("readyReplicas", 0))}

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
