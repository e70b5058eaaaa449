"""Structured output with the openai SDK against the default model (plans/smollm2-http.toml):
``parse`` sends the Pydantic model's JSON schema as ``response_format`` and reads the
answer back into the model; the grammar engine holds every token to the schema, so the
answer always validates, even where max_tokens is tight."""

import openai
import pydantic

client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=24)
    country: str = pydantic.Field(max_length=24)
    population: int = pydantic.Field(ge=0, le=100_000_000)


done = client.chat.completions.parse(
    model="smollm2-135m",
    messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    response_format=City,
    temperature=0,
    max_tokens=60,
)
city = done.choices[0].message.parsed
print(type(city).__name__, city.model_dump_json())
