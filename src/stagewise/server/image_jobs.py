"""Chat requests with images, after their JSON and template (intake threads): the image URLs are
downloaded in the image intake's fetch pool, all at once, then the images are decoded and encoded
and the request finished in its decode pool. Neither pool is the intake's, so a slow host or a
heavy image delays only its own request; a request that finds the pools full gets 503."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Callable

from ..multimodal.intake import MAX_PENDING
from .errors import APIError, bad_request
from .serving import stopping


@dataclass
class ImagesJob:
    text: str                          # the rendered conversation, one image token per image
    parts: Any                         # multimodal.intake.ImageParts: [(source, where)]
    finish: Callable[[Any], Any]       # the prompt (PromptInput) -> the request's routes.Job


async def run_images_job(serving, job: ImagesJob):
    """The routes.Job of an image request, its images fetched and encoded off the intake threads."""
    from ..multimodal.images import ImageError
    intake = serving.images
    if len(job.parts) > intake.limits.max_images:
        raise bad_request(f"The request has {len(job.parts)} images, over the limit of {intake.limits.max_images} "
                          f"(--max-images-per-request).", "messages")
    if intake.pending >= MAX_PENDING:
        raise APIError("The server is busy with other requests' images; retry in a few seconds.", 503, None, None,
                       "service_unavailable")
    intake.pending += 1
    loop = asyncio.get_running_loop()
    try:
        fetched = await asyncio.gather(*(_source(loop, intake, src, where) for src, where in job.parts))
        job.parts[:] = [(src, where) for src, (_, where) in zip(fetched, job.parts)]
        if serving.closed or serving.engine.draining or serving.engine.stopping:
            raise stopping()          # no decoding for a request the engine will not take
        return await loop.run_in_executor(intake.decoders, _encode, serving, job)
    except ImageError as exc:
        raise _refusal(exc) from None
    except (asyncio.CancelledError, RuntimeError):
        if not serving.closed:
            raise
        raise stopping() from None
    finally:
        intake.pending -= 1


async def _source(loop, intake, source, where: str):
    if isinstance(source, str) and source.startswith(("http://", "https://")):
        return await loop.run_in_executor(intake.fetchers, intake.fetch, source, where)
    return source


def _encode(serving, job: ImagesJob):
    from ..multimodal.images import ImageError
    try:
        prompt = serving.images.prompt(job.text, job.parts)
    except ImageError as exc:
        raise _refusal(exc) from None
    return job.finish(prompt)


def _refusal(exc) -> APIError:
    return bad_request(str(exc), exc.where.replace("[", ".").replace("]", ""))
