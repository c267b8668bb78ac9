"""Scripted LLM answers for the synth tests: a meeting-room booking environment and 3 scenarios.

Each stage gets its own model name (``stage_models()``), so each stage has its own script on the
replay server. Stages that run concurrently (methods, scenarios) are told apart by ``match``: a step
is served to the first request whose prompt contains its ``match`` text (MatchingReplayServer).
"""

from __future__ import annotations

import json
from typing import Any

from tests.support.openai_replay import ReplayServer, Step

STAGES = ("stateful", "topic", "state", "skeleton", "operations", "method", "tester", "judge",
          "initial_state", "task", "checklist", "check_funcs", "reference", "scenario_repair")

SEED = {
    "task_id": "toolace_001",
    "source": "toolace-style",
    "domain": "hospitality",
    "task": "I need to book a meeting room for 6 people tomorrow from 2pm to 4pm and cancel my old booking.",
    "apis": [{"name": "book_room", "description": "Reserve a room"}],
}
ENV_ID = "meeting_room_booking"
CLASS_NAME = "MeetingRoomBooking"


class MatchingReplayServer(ReplayServer):
    """A ReplayServer whose steps may carry ``match``: served only to a request whose prompt has that text.

    A step without ``match`` is served to any request of its model; among the steps that fit, the
    first is served. This keeps answers with their requests when a stage runs concurrently.
    """

    def _next_step(self, model: str) -> Step | None:
        with self._lock:
            request = self.requests[-1]
            prompt = "\n".join(str(m.get("content", "")) for m in request.get("messages", []))
            key = model if model in self.scripts else "*"
            steps = self.scripts.get(key, [])
            for index, step in enumerate(steps):
                if step.get("match") is None or step["match"] in prompt:
                    return steps.pop(index)
            return None


def stage_models() -> dict[str, dict[str, str]]:
    """Per-stage settings that route every stage to its own script (model name = stage name)."""
    return {stage: {"model": stage} for stage in STAGES}


def answer(value: Any, **extra: Any) -> Step:
    """A step answering ``value`` as JSON text."""
    return {"content": json.dumps(value), **extra}


SKELETON = '''from typing import Dict, TypedDict


class RoomInfo(TypedDict):
    room_id: str
    name: str
    floor: int
    capacity: int


class BookingInfo(TypedDict):
    booking_id: str
    room_id: str
    organizer: str
    start: str
    end: str
    attendees: int
    status: str


class MeetingRoomBooking:
    """Rooms and their bookings.

    Rules: attendees must fit the room's capacity; an active booking may not overlap another active
    booking of the same room; cancelled bookings stay on record.
    """

    def __init__(self, init_config: dict):
        self.rooms: Dict[str, RoomInfo] = {}
        self.bookings: Dict[str, BookingInfo] = {}
'''

METHODS = {
    "search_rooms": '''def search_rooms(self, min_capacity: int, start: str, end: str) -> dict:
    """Rooms with enough seats that are free for the whole slot.

    Args:
        min_capacity (int): Seats needed.
        start (str): Slot start, ISO date-time.
        end (str): Slot end, ISO date-time.
    """
    if start >= end:
        return {"success": False, "error": "start must be before end"}
    free = []
    for room in self.rooms.values():
        if room["capacity"] < min_capacity:
            continue
        busy = any(b["room_id"] == room["room_id"] and b["status"] == "active"
                   and b["start"] < end and start < b["end"] for b in self.bookings.values())
        if not busy:
            free.append(room)
    return {"success": True, "data": free}
''',
    "get_booking": '''def get_booking(self, booking_id: str) -> dict:
    """Read one booking.

    Args:
        booking_id (str): Id of the booking.
    """
    if booking_id not in self.bookings:
        return {"success": False, "error": f"no booking {booking_id}"}
    return {"success": True, "data": self.bookings[booking_id]}
''',
    "book_room": '''def book_room(self, room_id: str, organizer: str, start: str, end: str, attendees: int) -> dict:
    """Book a room for a slot.

    Args:
        room_id (str): Id of the room.
        organizer (str): Who books it.
        start (str): Slot start, ISO date-time.
        end (str): Slot end, ISO date-time.
        attendees (int): Number of people.
    """
    room = self.rooms.get(room_id)
    if room is None:
        return {"success": False, "error": f"no room {room_id}"}
    if start >= end:
        return {"success": False, "error": "start must be before end"}
    if attendees > room["capacity"]:
        return {"success": False, "error": f"{room_id} seats {room['capacity']}, not {attendees}"}
    for other in self.bookings.values():
        if other["room_id"] == room_id and other["status"] == "active" and other["start"] < end and start < other["end"]:
            return {"success": False, "error": f"{room_id} is taken by {other['booking_id']}"}
    booking_id = f"BK{len(self.bookings) + 1:03d}"
    self.bookings[booking_id] = {"booking_id": booking_id, "room_id": room_id, "organizer": organizer,
                                 "start": start, "end": end, "attendees": attendees, "status": "active"}
    return {"success": True, "data": self.bookings[booking_id]}
''',
    "cancel_booking": '''def cancel_booking(self, booking_id: str) -> dict:
    """Cancel an active booking.

    Args:
        booking_id (str): Id of the booking.
    """
    booking = self.bookings.get(booking_id)
    if booking is None:
        return {"success": False, "error": f"no booking {booking_id}"}
    if booking["status"] != "active":
        return {"success": False, "error": f"{booking_id} is already {booking['status']}"}
    booking["status"] = "cancelled"
    return {"success": True, "data": booking}
''',
}

# Crashes with a KeyError on an unknown id: the dual-agent check catches it at run time.
CRASHING_CANCEL = '''def cancel_booking(self, booking_id: str) -> dict:
    """Cancel an active booking.

    Args:
        booking_id (str): Id of the booking.
    """
    self.bookings[booking_id]["status"] = "cancelled"
    return {"success": True, "data": self.bookings[booking_id]}
'''

OPERATIONS = [
    {"name": "search_rooms", "kind": "query", "description": "free rooms with enough seats for a slot",
     "parameters": [{"name": "min_capacity", "type": "int"}, {"name": "start", "type": "str"}, {"name": "end", "type": "str"}]},
    {"name": "get_booking", "kind": "query", "description": "one booking",
     "parameters": [{"name": "booking_id", "type": "str"}]},
    {"name": "book_room", "kind": "change", "description": "book a room",
     "parameters": [{"name": "room_id", "type": "str"}, {"name": "organizer", "type": "str"},
                    {"name": "start", "type": "str"}, {"name": "end", "type": "str"},
                    {"name": "attendees", "type": "int"}]},
    {"name": "cancel_booking", "kind": "change", "description": "cancel a booking",
     "parameters": [{"name": "booking_id", "type": "str"}]},
]


def rooms(label: str) -> dict[str, Any]:
    return {
        "R1": {"room_id": "R1", "name": f"{label} Hall", "floor": 3, "capacity": 8},
        "R2": {"room_id": "R2", "name": f"{label} Nook", "floor": 2, "capacity": 4},
    }


def booking(booking_id: str, room_id: str, organizer: str, start: str, end: str, attendees: int) -> dict[str, Any]:
    return {"booking_id": booking_id, "room_id": room_id, "organizer": organizer, "start": start, "end": end,
            "attendees": attendees, "status": "active"}


def case(tool: str, arguments: dict[str, Any], kind: str, intent: str) -> dict[str, Any]:
    """One tester call on the tester's only initial state."""
    return {"state": 0, "tool": tool, "arguments": arguments, "kind": kind, "intent": intent}


TESTER_STATE = {"rooms": rooms("Test"),
                "bookings": {"BK001": booking("BK001", "R1", "alice", "2025-05-01T10:00", "2025-05-01T11:00", 5)}}
TESTER = {
    "initial_states": [TESTER_STATE],
    "cases": [
        case("search_rooms", {"min_capacity": 6, "start": "2025-05-01T10:30", "end": "2025-05-01T12:00"},
             "positive", "R1 is busy, no room fits"),
        case("search_rooms", {"min_capacity": 2, "start": "2025-05-01T12:00", "end": "2025-05-01T11:00"},
             "negative", "reversed slot"),
        case("get_booking", {"booking_id": "BK001"}, "positive", "read it"),
        case("get_booking", {"booking_id": "BK404"}, "negative", "unknown id"),
        case("book_room", {"room_id": "R2", "organizer": "bo", "start": "2025-05-01T10:00", "end": "2025-05-01T11:00",
                           "attendees": 3}, "positive", "books R2"),
        case("book_room", {"room_id": "R1", "organizer": "bo", "start": "2025-05-01T10:30", "end": "2025-05-01T11:30",
                           "attendees": 3}, "negative", "overlap refused"),
        case("cancel_booking", {"booking_id": "BK001"}, "positive", "cancels"),
        case("cancel_booking", {"booking_id": "BK404"}, "negative", "unknown id refused"),
    ],
}
ALL_PASS = {"verdicts": [{"case": i, "verdict": "pass", "reason": "as intended"} for i in range(len(TESTER["cases"]))]}


def scenario_answers(label: str, index: int, count: int = 3) -> dict[str, list[Step]]:
    """The five scenario stages' answers for scenario ``index``, told apart by ``label`` (in the rooms' names)."""
    base = {"rooms": rooms(label),
            "bookings": {"BK001": booking("BK001", "R1", "alice", "2025-05-02T09:00", "2025-05-02T10:00", 4)}}
    if index == 1:
        task = f"Book a room in {label} for 6 people on 2025-05-02 from 14:00 to 16:00, organised by dana."
        checklist = ["dana has an active booking of R1 from 14:00 to 16:00", "alice's booking is untouched"]
        checks = [
            'def check_func(final_state):\n    return any(b["organizer"] == "dana" and b["room_id"] == "R1"'
            ' and b["status"] == "active" and b["start"] == "2025-05-02T14:00"'
            ' for b in final_state["bookings"].values())\n',
            'def check_func(final_state):\n    return final_state["bookings"]["BK001"] == initial_state["bookings"]["BK001"]\n',
        ]
        slot = {"start": "2025-05-02T14:00", "end": "2025-05-02T16:00"}
        reference = [{"name": "search_rooms", "arguments": {"min_capacity": 6, **slot}},
                     {"name": "book_room", "arguments": {"room_id": "R1", "organizer": "dana", "start": "2025-05-02T14:00",
                                                         "end": "2025-05-02T16:00", "attendees": 6}}]
    elif index == 2:
        task = f"In {label}, cancel alice's booking BK001 of 2025-05-02 09:00."
        checklist = ["BK001 is cancelled"]
        checks = ['def check_func(final_state):\n    return final_state["bookings"]["BK001"]["status"] == "cancelled"\n']
        reference = [{"name": "get_booking", "arguments": {"booking_id": "BK001"}},
                     {"name": "cancel_booking", "arguments": {"booking_id": "BK001"}}]
    else:
        task = (f"In {label}, move alice's 09:00 meeting (BK001) to R2: "
                "cancel BK001 and book R2 for her 4 people, same slot.")
        checklist = ["BK001 is cancelled", "alice has an active booking of R2 from 09:00 to 10:00"]
        checks = [
            'def check_func(final_state):\n    return final_state["bookings"]["BK001"]["status"] == "cancelled"\n',
            'def check_func(final_state):\n    return any(b["organizer"] == "alice" and b["room_id"] == "R2"'
            ' and b["status"] == "active" for b in final_state["bookings"].values())\n',
        ]
        reference = [{"name": "cancel_booking", "arguments": {"booking_id": "BK001"}},
                     {"name": "book_room", "arguments": {"room_id": "R2", "organizer": "alice", "start": "2025-05-02T09:00",
                                                         "end": "2025-05-02T10:00", "attendees": 4}}]
    return {
        "initial_state": [answer({"init_config": base}, match=f"initial state {index} of {count}")],
        "task": [answer({"task": task}, match=f"{label} Hall")],
        "checklist": [answer({"checklist": checklist}, match=label)],
        "check_funcs": [answer({"check_funcs": checks}, match=label)],
        "reference": [answer({"reference_solution": reference}, match=label)],
    }


LABELS = ("Aurora", "Borealis", "Cirrus")


def env_script() -> dict[str, list[Step]]:
    """Every SkelBuilder stage's answers for the seed task: 11 requests, all accepted first time."""
    return {
        "stateful": [answer({"stateful": True, "reason": "bookings are created and cancelled"})],
        "topic": [answer({"env_name": "MeetingRoomBooking", "summary": "Meeting rooms and their bookings.",
                          "introduction": "You manage the meeting rooms of an office: find free rooms, book and cancel.",
                          "usefulness": 8, "modelability": 9})],
        "state": [answer({
            "entities": [
                {"name": "RoomInfo", "attributes": {"room_id": "str", "name": "str", "floor": "int", "capacity": "int"}},
                {"name": "BookingInfo", "attributes": {"booking_id": "str", "room_id": "str", "organizer": "str",
                                                       "start": "str", "end": "str", "attendees": "int", "status": "str"}},
            ],
            "state_attributes": {"rooms": "Dict[str, RoomInfo]", "bookings": "Dict[str, BookingInfo]"},
            "rules": ["attendees fit the capacity", "no overlapping active bookings per room"],
        })],
        "skeleton": [answer({"class_name": CLASS_NAME, "code": SKELETON})],
        "operations": [answer({"operations": OPERATIONS})],
        "method": [answer({"code": code}, match=f'"name": "{name}"') for name, code in METHODS.items()],
        "tester": [answer(TESTER)],
        "judge": [answer(ALL_PASS)],
    }


def scenario_script(count: int = 3) -> dict[str, list[Step]]:
    """The ScenGenerator stages' answers for ``count`` scenarios (5 requests each)."""
    script: dict[str, list[Step]] = {}
    for index, label in enumerate(LABELS[:count], start=1):
        for stage, steps in scenario_answers(label, index, count).items():
            script.setdefault(stage, []).extend(steps)
    return script


def full_script(count: int = 3) -> dict[str, list[Step]]:
    """env_script and scenario_script together."""
    return {**env_script(), **scenario_script(count)}
