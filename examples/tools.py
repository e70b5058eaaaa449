"""Tool calling with the openai SDK against the default model (plans/smollm2-http.toml):
the model asks for a function call, the caller runs the function and sends its result
back, and the model answers with it. The call's arguments follow the function's schema
(tool_choice "required": the grammar engine holds them to it)."""

import json

import openai

client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
weather = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": weather}}
]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]

asked = client.chat.completions.create(
    model="smollm2-135m",
    messages=messages,
    tools=tools,
    tool_choice="required",
    parallel_tool_calls=False,
    temperature=0,
)
call = asked.choices[0].message.tool_calls[0]
arguments = json.loads(call.function.arguments)
print(asked.choices[0].finish_reason, call.function.name, arguments)

result = {"city": arguments["city"], "sky": "sunny", "celsius": 21}  # the function, run by the caller
messages += [asked.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}]
answer = client.chat.completions.create(model="smollm2-135m", messages=messages, temperature=0, max_tokens=60)
print(answer.choices[0].message.content)
