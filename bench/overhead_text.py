"""The overhead scenario's text (`bench/overhead.py`): its stub forward writes the most frequent
tokens of this fixed English prose. Kept apart from any document, so that editing one never
changes the benchmark; changing it does."""

TEXT = """\
The harbour town wakes early. Before the sun clears the hills, fishing boats slip out past the old stone
lighthouse, their engines low and steady, while gulls circle above the market square. By seven o'clock the
bakery on the corner has sold most of its bread, and the smell of coffee drifts from a small café where two
retired teachers argue, as they do every morning, about the weather, the price of fuel and whether the new
bridge will ever be finished.

Visitors often ask why so many houses are painted in bright colours: red, yellow, pale green and deep blue.
One story says that sailors wanted to recognise their homes from far out at sea; another claims a mayor
simply bought too much paint in 1923 and gave it away. Nobody really knows, and most people prefer it that
way. What matters is that the streets look cheerful even in February, when rain blows in from the west for
days at a time.

Life here follows the tides rather than the clock. When the water is high, children jump from the pier and
swim to the wooden raft anchored near the beach. When it is low, families walk across the wet sand to
collect shells, crabs and smooth pebbles. A notice by the slipway warns that the current can be dangerous
after storms, yet every summer someone ignores it and has to be rescued by the volunteer crew.

The school has only three classrooms, but its library is surprisingly large. Years ago, a local writer left
her whole collection of books to the village, including maps, diaries, letters and several thousand novels.
Students use them for projects on history, geography and science. Last spring, a group of twelve-year-olds
studied the diaries and discovered that a famous shipwreck had happened a week earlier than every guide
book claimed. Their teacher sent the evidence to a museum, which quietly corrected its records.

In autumn the town holds a festival. There is music in the evenings, a race for rowing boats, and a long
table set up along the quay where anyone may bring food to share. Recipes are guarded carefully: one family
has made the same fish soup for over a hundred years, and they will tell you the secret only if you promise
never to write it down. Tourists come by train and by car, filling every hotel and guest house, and for
three days the population almost doubles.

Winter is quieter. Many shops close early, and the ferry to the island runs just twice a week. Still, people
find plenty to do. They repair nets, mend fences, paint their boats and plan the next season. In the pub,
older men play cards and tell stories that grow a little longer each year. Younger people sometimes leave
for the city, looking for work, education or adventure; a few return later with new ideas, opening a small
brewery, a repair workshop or an online business that sells knitted sweaters to customers around the world.

If you visit, take a walk along the cliff path at sunset. From the top you can see the whole bay, the
scattered islands and, on clear evenings, the mountains on the far coast. Bring a warm jacket, because the
wind can change quickly, and remember that the last bus leaves at nine. Should you miss it, don't worry:
someone will almost certainly offer you a lift, ask where you are from, and insist that you stay for dinner.
"""
